"""GPU checks of the engine (skipped with a reason on machines without CUDA): our CUDA path (Triton
attention, fused ops, CUDA graphs) produces the same greedy tokens as the torch path on the GPU."""
import pytest
import torch

from flame_llm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 300, 77, 1000)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_path_matches_torch_path(tiny_model, dtype):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(tiny_model, dtype=dtype, attention_backend="torch", enforce_eager=True, fused_ops=False,
              block_size=16).generate(prompts(), sp, use_tqdm=False)
    for eager in (True, False):
        llm = LLM(tiny_model, dtype=dtype, attention_backend="triton", enforce_eager=eager, block_size=16)
        outs = llm.generate(prompts(), sp, use_tqdm=False)
        again = llm.generate(prompts(), sp, use_tqdm=False)  # prefix-cache hits on the second pass
        assert [o.output_token_ids for o in outs] == [r.output_token_ids for r in ref], f"eager={eager}"
        assert [o.output_token_ids for o in again] == [r.output_token_ids for r in ref], f"eager={eager}"
        assert sum(o.num_cached_tokens for o in again) > 0
