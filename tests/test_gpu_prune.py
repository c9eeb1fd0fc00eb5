"""Config.prune_last_layer on a GPU (skipped with a reason elsewhere): eager steps' last layer on the sampled rows
only gives the greedy tokens of the unpruned engine (fp32: identical; bf16: the prefill's first tokens identical and
the sampled rows' hidden states within bf16 rounding), on our Triton kernel and on the auto backend (flash-attn-4 on
an H200: the kept rows still take our Triton decode kernel, so no FA4 variant compiles after warmup)."""
import pytest
import torch

from flame_llm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 300, 77, 1000, 1500)]


def _generate(path: str, prune: bool, **kw) -> tuple[list[list[int]], int, LLM]:
    """Greedy tokens (a second pass hits the prefix cache) and how many forwards ran pruned."""
    # a fixed KV pool: two engines live in this process; steps with prefill tokens eager (no mixed graphs) and
    # larger than a graph bucket anyway, chunked so the long prompts' middle chunks sample nothing
    llm = LLM(path, block_size=16, num_kvcache_blocks=1024, enable_chunked_prefill=True, max_num_batched_tokens=512,
              cuda_graph_mixed_tokens=0, prune_last_layer=prune, **kw)
    model, pruned = llm.engine.model_runner.model, []
    inner = model.forward
    model.forward = lambda ids, pos, *a, **k: (pruned.append(1) if a or k else None) or inner(ids, pos, *a, **k)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = [o.output_token_ids for o in llm.generate(prompts(), sp, use_tqdm=False)]
    again = llm.generate(prompts(), sp, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    return outs + [o.output_token_ids for o in again], len(pruned), llm


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_fp32_tokens_identical_on_and_off(tiny_model, backend):
    off, n_off, _ = _generate(tiny_model, False, dtype="float32", attention_backend=backend)
    on, n_on, _ = _generate(tiny_model, True, dtype="float32", attention_backend=backend)
    assert on == off and n_off == 0 and n_on > 0


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_bf16_first_tokens_identical_and_hidden_close(tiny_model, backend):
    off, _, _ = _generate(tiny_model, False, dtype="bfloat16", attention_backend=backend)
    on, n_on, llm = _generate(tiny_model, True, dtype="bfloat16", attention_backend=backend)
    assert n_on > 0 and [o[0] for o in on] == [o[0] for o in off]
    runner = llm.engine.model_runner
    jit_before = runner.attention_jit_compiles()
    # one step of every prompt's whole prefill, pruned and not, on the engine's own cache
    from flame_llm.engine.sequence import Sequence

    seqs, nxt = [], 900
    for p in prompts()[:4]:
        s = Sequence(p, SamplingParams(temperature=0, max_tokens=1), 16)
        s.block_table = list(range(nxt, nxt + (len(p) + 15) // 16))
        nxt += len(s.block_table)
        seqs.append(s)
    x = runner.prepare(seqs, [s.num_tokens for s in seqs], [0] * len(seqs))
    with torch.inference_mode():
        full = runner.upload(x)
        ref = runner.forward(full)[full.logits_rows].float()
        out = runner.forward(runner.upload(x, prune=True), prune=True).float()
    torch.testing.assert_close(out, ref, rtol=0.03, atol=0.03 * ref.abs().max().item())
    assert runner.attention_jit_compiles() == jit_before, "the kept rows compiled an attention kernel just in time"
