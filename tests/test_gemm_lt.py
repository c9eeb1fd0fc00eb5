"""RunnerConfig.gemm_lt_min_tokens: its checks, that it is off by default and that off leaves every projection on
F.linear, that it refuses a CPU engine with an error naming it, and LtLinear's choice of a plan per step size and
its way back to F.linear. cuBLASLt itself needs a GPU (tests/test_gpu_gemm_lt.py): the gemm here is a stand-in
that records what it is asked, named so."""
import pytest
import torch
import torch.nn.functional as F

from flame_llm import LLM
from flame_llm.config import Config, EngineConfig
from flame_llm.kernels import cublaslt
from flame_llm.kernels.cublaslt import LtLinear, tune_ms
from flame_llm.layers.layers import Linear


def test_tune_ms_doubles_from_the_flag_to_the_step_budget():
    assert tune_ms(1024, 8192) == [1024, 2048, 4096, 8192]
    assert tune_ms(1000, 8192) == [1000, 2000, 4000, 8000, 8192]
    assert tune_ms(8192, 8192) == [8192]
    assert tune_ms(100, 150) == [100, 150]


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1024"])
def test_bad_values_name_the_field(tiny_llama, bad):
    with pytest.raises(ValueError, match="gemm_lt_min_tokens"):
        EngineConfig.from_kwargs(gemm_lt_min_tokens=bad)
    with pytest.raises(ValueError, match="gemm_lt_min_tokens"):
        Config.from_kwargs(tiny_llama, gemm_lt_min_tokens=bad)


def test_a_threshold_above_the_step_budget_is_refused():
    with pytest.raises(ValueError, match=r"gemm_lt_min_tokens.*max_num_batched_tokens \(512\)"):
        EngineConfig.from_kwargs(gemm_lt_min_tokens=513, max_num_batched_tokens=512)
    assert EngineConfig.from_kwargs(gemm_lt_min_tokens=512, max_num_batched_tokens=512)


def test_off_by_default_and_off_leaves_every_projection_on_f_linear(tiny_llama):
    assert Config.from_kwargs(tiny_llama).runner_config.gemm_lt_min_tokens == 0
    on = EngineConfig.from_kwargs(gemm_lt_min_tokens=1024)
    assert on.to_kwargs(changed_only=True) == {"gemm_lt_min_tokens": 1024}
    llm = LLM(tiny_llama, num_kvcache_blocks=64, max_model_len=128)
    linears = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.lt is None for m in linears)


def test_a_cpu_engine_with_the_flag_is_refused_naming_it(tiny_llama):
    with pytest.raises(ValueError, match=r"gemm_lt_min_tokens.*CUDA.*set it to 0"):
        LLM(tiny_llama, gemm_lt_min_tokens=16, num_kvcache_blocks=64, max_model_len=128)


class FakeGemmNoGpu:
    """Stands in for kernels.cublaslt.LtGemm, which needs cuBLASLt on a GPU: supports() says yes except for the
    step sizes in `unsupported`, and matmul() records (algo, rows) and computes F.linear."""

    def __init__(self, n: int, unsupported: tuple[int, ...] = ()):
        self.n, self.unsupported, self.calls, self.checked = n, unsupported, [], []

    def supports(self, algo, m: int) -> bool:
        self.checked.append(m)
        return m not in self.unsupported

    def matmul(self, algo, x, w, y):
        self.calls.append((algo, x.shape[0]))
        return torch.mm(x, w.t(), out=y)


@pytest.fixture
def cpu_align(monkeypatch):
    """torch's CPU allocator aligns to 64 bytes, CUDA's caching allocator to 512: LtLinear's 256 becomes 64."""
    monkeypatch.setattr(cublaslt, "ALIGN", 64)


def test_lt_linear_uses_the_largest_tuned_size_at_or_below_the_step(cpu_align):
    gemm = FakeGemmNoGpu(6, unsupported=(3000,))
    plan = LtLinear(gemm, {1024: "a1k", 2048: None, 4096: "a4k"})
    w = torch.randn(6, 4)
    assert plan(torch.randn(1023, 4), w) is None and gemm.checked == []  # below the flag: F.linear, no check
    for m, algo in ((1024, "a1k"), (1500, "a1k"), (4096, "a4k"), (8192, "a4k")):
        x = torch.randn(m, 4)
        y = plan(x, w)
        assert gemm.calls[-1] == (algo, m) and torch.allclose(y, F.linear(x, w)) and y.shape == (m, 6)
    n = len(gemm.calls)
    assert plan(torch.randn(2048, 4), w) is None and plan(torch.randn(2500, 4), w) is None  # F.linear won there
    assert plan(torch.randn(3000, 4), w) is None  # the 2048 plan's None; 3000 is not even checked
    assert plan(torch.randn(5000, 4)[::2], w) is None  # not contiguous
    assert plan(torch.randn(4 * 5000 + 1)[1:].view(5000, 4), w) is None  # 4 bytes past an aligned address
    assert len(gemm.calls) == n
    assert plan.outcomes == {"small": 1, "layout": 2, "cublas": 3, "lt": 4}
    plan2 = LtLinear(FakeGemmNoGpu(6, unsupported=(4500,)), {4096: "a4k"})
    assert plan2(torch.randn(4500, 4), w) is None and plan2(torch.randn(4500, 4), w) is None
    assert plan2.gemm.checked == [4500]  # AlgoCheck once per step size


def test_linear_forward_falls_back_to_f_linear_when_the_plan_declines(cpu_align):
    lin = Linear(4, 6)
    torch.nn.init.normal_(lin.weight)
    gemm = FakeGemmNoGpu(6)
    lin.lt = LtLinear(gemm, {8: "a8"})
    small, big = torch.randn(5, 4), torch.randn(9, 4)
    assert torch.equal(lin(small), F.linear(small, lin.weight)) and gemm.calls == []
    assert torch.allclose(lin(big), F.linear(big, lin.weight)) and gemm.calls == [("a8", 9)]


def test_flag_ab_refuses_to_toggle_the_flag_on_an_engine_built_without_plans():
    """bench.flag_ab builds the engine with --on; on a CPU engine the flag itself is refused first, naming it."""
    from bench import flag_ab
    with pytest.raises(ValueError, match="gemm_lt_min_tokens"):
        flag_ab.main(["--model", "tiny", "--flag", "gemm_lt_min_tokens", "--on", "16", "--prompts", "2",
                      "--prompt-tokens", "40", "--max-num-batched-tokens", "32"])
    with pytest.raises(SystemExit, match="built without cuBLASLt plans"):
        flag_ab._set_gemm_lt(type("RunnerWithoutPlans", (), {"lt_plans": {}})(), 1024)
