"""RunnerConfig.gemm_lt_min_tokens on a GPU (skipped with a reason elsewhere): cuBLASLt's candidates for Llama-3.1-8B's
projection shapes, picked at one step size, give F.linear's output bitwise there and run other sizes the plan
covers; an engine with the flag runs its eager steps on the plans and samples the same greedy tokens as without
(Llama-3.1-8B shapes in 2 layers, bf16, dummy weights); graph-replayed steps never call cuBLASLt."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from flame_llm import LLM, SamplingParams
from flame_llm.kernels import cublaslt
from flame_llm.models.llama import set_gemm_lt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MODELS = os.path.join(os.path.dirname(__file__), "..", "configs", "models")
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _spy(monkeypatch) -> list[int]:
    """The row count of every cuBLASLt matmul from now on."""
    calls, inner = [], cublaslt.LtGemm.matmul

    def matmul(self, algo, x, w, y):
        calls.append(x.shape[0])
        return inner(self, algo, x, w, y)

    monkeypatch.setattr(cublaslt.LtGemm, "matmul", matmul)
    return calls


@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (4096, 14336)])
def test_candidates_at_8b_shapes_are_bitwise_f_linear_where_picked(n, k):
    g = torch.Generator(device="cuda").manual_seed(n)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    gemm = cublaslt.LtGemm(n, k)
    algo, info = cublaslt.pick(gemm, w, 2048)
    assert info["offered"] >= 1 and info["bitwise"] >= 1, info
    x = torch.randn(2048, k, device="cuda").bfloat16()
    y = torch.empty(2048, n, device="cuda", dtype=torch.bfloat16)
    bitwise = [h.algo for h in gemm.candidates(2048, 16) if torch.equal(gemm.matmul(h.algo, x, w, y), F.linear(x, w))]
    assert len(bitwise) == info["bitwise"]
    plan = cublaslt.LtLinear(gemm, {2048: algo or bitwise[0]})
    for m in (2048, 3000, 4096):
        x = torch.randn(m, k, device="cuda").bfloat16()
        y, ref = plan(x, w), F.linear(x, w)
        assert y is not None and y.shape == (m, n)
        if m == 2048:
            assert torch.equal(y, ref)
        rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 1e-2, (m, rel)
    buf = torch.randn(2048 * k + 1, device="cuda").bfloat16()
    assert plan(buf[1:].view(2048, k), w) is None  # 2 bytes past an aligned address: F.linear's


def _two_layer_8b(tmp_path) -> str:
    """Llama-3.1-8B's config with 2 layers: its projection shapes, where the H200 offers bitwise candidates."""
    with open(os.path.join(MODELS, "llama-3.1-8b", "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_engine_eager_steps_on_cublaslt_same_greedy_tokens(monkeypatch, tmp_path):
    monkeypatch.setattr(cublaslt, "MIN_GAIN", -1.0)  # the fastest bitwise candidate wherever one exists: the path runs
    calls = _spy(monkeypatch)
    llm = LLM(_two_layer_8b(tmp_path), load_format="dummy", enable_chunked_prefill=True,
              max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=4096, num_kvcache_blocks=256,
              gemm_lt_min_tokens=1024, enable_prefix_caching=False)  # every round computes the same steps
    runner = llm.engine.model_runner
    assert runner.lt_plans and runner.use_graphs
    records = [r for p in runner.lt_plans.values() for r in p.records]
    assert any(r["used"] != "cublas" for r in records), records
    n_tuning = len(calls)
    assert n_tuning > 0  # the warmup timed candidates
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, llm.engine.vocab_size, (1500,), generator=g).tolist() for _ in range(3)]
    short = [torch.randint(3, llm.engine.vocab_size, (40,), generator=g).tolist() for _ in range(4)]
    llm.generate(short, SP, use_tqdm=False)  # graph-replayed steps (mixed and decode)
    assert len(calls) == n_tuning, "a graph-replayed step called cuBLASLt"
    tokens = {}
    for on in (True, False, True):
        set_gemm_lt(runner.model, runner.lt_plans if on else {})
        n = len(calls)
        tokens.setdefault(on, []).append([o.output_token_ids for o in llm.generate(prompts, SP, use_tqdm=False)])
        outcomes = {p.gemm.n: dict(p.outcomes) for p in runner.lt_plans.values()}
        assert (len(calls) > n) == on and all(m >= 1024 for m in calls[n:]), (on, calls[n:][:8], outcomes, records)
    assert tokens[True][0] == tokens[False][0] == tokens[True][1]
