"""GPU checks of the engine (skipped with a reason on machines without CUDA): our CUDA path (Triton
attention, fused ops, CUDA graphs) produces the same greedy tokens as the torch path on the GPU."""
import pytest
import torch

from flame_llm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 300, 77, 1000)]


def _generate(path, dtype, **kw):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(path, dtype=dtype, block_size=16, num_kvcache_blocks=1024, **kw)
    outs = llm.generate(prompts(), sp, use_tqdm=False)
    again = llm.generate(prompts(), sp, use_tqdm=False)  # prefix-cache hits on the second pass
    assert sum(o.num_cached_tokens for o in again) > 0
    return [o.output_token_ids for o in outs], [o.output_token_ids for o in again]


@pytest.mark.parametrize("eager", [True, False])
def test_cuda_path_matches_torch_path_fp32(tiny_model, eager):
    """float32: token-identical to the torch path (Triton attention, fused ops, CUDA graphs)."""
    ref, _ = _generate(tiny_model, "float32", attention_backend="torch", enforce_eager=True, fused_ops=False)
    outs, again = _generate(tiny_model, "float32", attention_backend="triton", enforce_eager=eager)
    assert outs == ref and again == ref


def test_cuda_path_tracks_torch_path_bf16(tiny_model):
    """bfloat16: rounding differs between fused and unfused ops, so a near-tie in a random tiny model
    can flip a later greedy token; the first token of every prompt (prefill) must agree, and most
    tokens overall."""
    ref, _ = _generate(tiny_model, "bfloat16", attention_backend="torch", enforce_eager=True, fused_ops=False)
    outs, again = _generate(tiny_model, "bfloat16", attention_backend="triton")
    assert [o[0] for o in outs] == [r[0] for r in ref]
    assert [o[0] for o in again] == [r[0] for r in ref]
    agree = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o, r)) / sum(map(len, ref))
    assert agree >= 0.5, agree
