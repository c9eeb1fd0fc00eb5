"""flash-attn-4 prefill backend on a Hopper GPU (skipped with the reason where CUDA or flash_attn.cute is
missing): the paged kernel against the fp32 torch reference on fresh random inputs, the engine's tokens
against the torch path, and a startup warmup that leaves nothing to compile during serving."""
import pytest
import torch
from helpers import CASES_ATTENTION, make_case, reference

from flame_llm import LLM, SamplingParams


def _reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    from flame_llm.kernels.fa4_backend import fa4_unavailable_reason
    return fa4_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128)


REASON = _reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"flash-attn-4: {REASON}")]

LLAMA8B_SHAPES = {  # the seed traces' attention shapes (32 query / 8 KV heads, d128, pages of 256)
    "chunk_fresh_plus_tail": dict(seq_lens=[2048, 2048 + 64], q_lens=[2048, 64], num_heads=32, num_kv_heads=8,
                                  head_dim=128, block_size=256),
    "prefix_hits_and_decodes": dict(seq_lens=[1000, 1500, 700, 33], q_lens=[64, 64, 1, 1], num_heads=32,
                                    num_kv_heads=8, head_dim=128, block_size=256),
    "pages_of_128": dict(seq_lens=[500, 129], q_lens=[300, 129], num_heads=32, num_kv_heads=8, head_dim=128,
                         block_size=128),
}


@pytest.mark.parametrize("name", list(CASES_ATTENTION) + list(LLAMA8B_SHAPES))
def test_fa4_paged_attention_matches_torch(name):
    from flame_llm.kernels.fa4_backend import fa4_attention_forward

    case = (CASES_ATTENTION | LLAMA8B_SHAPES)[name] | dict(dtype=torch.bfloat16, device="cuda", pad_rows=0)
    (q, k, v, k_cache, v_cache), meta = make_case(**case)
    # the engine pads block tables with block 0 and keeps every cache row finite (zeros at start)
    meta.block_tables = meta.block_tables.clamp(min=0)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    meta.is_decode = False  # route every case through FA4, decodes included
    scale = case["head_dim"] ** -0.5
    k_ref, v_ref, ref = reference(q, k, v, k_cache, v_cache, meta, len(case["seq_lens"]), scale)
    out = fa4_attention_forward(q, k, v, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0)
    assert torch.isfinite(out).all()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= 1e-2, f"relative error {err:.2e}"


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(x),), generator=g).tolist()
            for x in torch.randint(1, 900, (n,), generator=g)]


def test_fa4_engine_first_tokens_match_our_triton_kernel(tiny_llama):
    """bf16 greedy, everything but the prefill attention kernel equal: the first token of every prompt (a
    fresh prefill, then a prefix hit on the second pass) agrees with our Triton kernel's."""
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    firsts = {}
    for backend in ("triton", "fa4"):
        # mixed-step graphs off: their steps run our Triton kernel whatever the backend
        llm = LLM(tiny_llama, dtype="bfloat16", attention_backend=backend, block_size=16, num_kvcache_blocks=2048,
                  cuda_graph_mixed_tokens=0)
        assert llm.engine.model_runner.backend == backend
        first = [o.output_token_ids for o in llm.generate(_prompts(24), sp, use_tqdm=False)]
        again = llm.generate(_prompts(24), sp, use_tqdm=False)
        assert sum(o.num_cached_tokens for o in again) > 0
        firsts[backend] = (first, [o.output_token_ids for o in again])
    assert firsts["fa4"] == firsts["triton"]


def test_fa4_warmup_leaves_nothing_to_compile_while_serving(tiny_llama):
    llm = LLM(tiny_llama, dtype="bfloat16", attention_backend="fa4", block_size=16, num_kvcache_blocks=4096,
              max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512, enable_chunked_prefill=True,
              cuda_graph_mixed_tokens=0)  # every step with prefill tokens on FA4
    # (the variants may already be in memory from an earlier test: warmup then compiles nothing new)
    prompts = _prompts(48, seed=1)
    prompts += [p[:300] + [7, 8] for p in prompts[:8] if len(p) > 300]  # prefix hits
    for batch in (prompts[:1], prompts[:3], prompts):  # one sequence, a few, then full mixed steps
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    from flame_llm.kernels.fa4_backend import new_variants
    assert llm.engine.stats()["attention_jit_compiles"] == 0, new_variants()


def test_mixed_step_graphs_track_fa4_eager_steps(tiny_llama):
    """The shipped configuration (fa4 backend, bf16): steps with prefill tokens up to 512 replay graphs on our Triton
    kernel instead of FA4 eagerly; every prompt's first token (fresh, then a prefix hit) is the same either way."""
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    firsts = {}
    for mixed in (0, None):
        llm = LLM(tiny_llama, dtype="bfloat16", attention_backend="fa4", block_size=16, num_kvcache_blocks=2048,
                  enable_chunked_prefill=True, max_num_batched_tokens=1024, cuda_graph_mixed_tokens=mixed)
        runner = llm.engine.model_runner
        assert (runner.mixed is None) == (mixed == 0)
        first = [o.output_token_ids for o in llm.generate(_prompts(24), sp, use_tqdm=False)]
        again = [o.output_token_ids for o in llm.generate(_prompts(24), sp, use_tqdm=False)]
        if runner.mixed is not None:
            assert runner.mixed.replays > 0
        firsts[mixed] = (first, again)
    assert firsts[None] == firsts[0]
