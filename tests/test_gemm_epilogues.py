"""Config.gemm_epilogues: the fused GEMM epilogues (CPU: the Triton kernel under the interpreter, the model
path with the torch compositions / torch.addmm) against today's path."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from helpers import make_prompts  # noqa: E402

from flame_llm import LLM, SamplingParams  # noqa: E402
from flame_llm.config import Config, parse_gemm_epilogues  # noqa: E402
from flame_llm.kernels.gemm_epilogue import (  # noqa: E402
    EPI_NONE,
    EPI_RESIDUAL,
    EPI_SWIGLU,
    epilogue_unavailable_reason,
    quack_module,
    residual_linear,
    swiglu_linear,
    triton_gemm,
)
from flame_llm.models.llama import MLP, DecoderLayer, configure_gemm_epilogues  # noqa: E402

SMALL = (32, 16, 16, 2, 4, 1)  # tiles the interpreter runs in seconds


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("m", [1, 37, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_gemm_epilogues_match_torch(m, dtype):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(m, 64, dtype=dtype, device=dev)
    w = torch.randn(96, 64, dtype=dtype, device=dev)  # N = 96 is not a multiple of the tile: masked edges
    r = torch.randn(m, 96, dtype=dtype, device=dev)
    ref = x.double() @ w.double().T
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert rel(triton_gemm(x, w, EPI_NONE, config=SMALL), ref) < tol
    assert rel(triton_gemm(x, w, EPI_RESIDUAL, r, config=SMALL), ref + r.double()) < tol
    g, u = ref.chunk(2, -1)
    got = triton_gemm(x, w, EPI_SWIGLU, config=SMALL)
    assert got.shape == (m, 48) and rel(got, F.silu(g) * u) < tol


def test_dispatch_off_cuda_is_the_torch_composition():
    x, w, r = torch.randn(5, 8), torch.randn(12, 8), torch.randn(5, 12)
    g, u = F.linear(x, w).chunk(2, -1)
    assert torch.equal(swiglu_linear(x, w, "triton"), F.silu(g) * u)
    assert rel(residual_linear(x, w, r, "triton"), F.linear(x, w) + r) < 1e-6


def test_spec_is_parsed_and_bad_specs_name_the_field(tiny_llama):
    assert parse_gemm_epilogues("") == {}
    assert parse_gemm_epilogues("swiglu=triton, residual=cublas") == {"swiglu": "triton", "residual": "cublas"}
    for bad in ("swiglu=cublas", "gelu=triton", "residual", "residual=cublas,residual=triton"):
        with pytest.raises(ValueError, match="gemm_epilogues"):
            parse_gemm_epilogues(bad)
    with pytest.raises(ValueError, match="gemm_epilogues"):
        Config.from_kwargs(tiny_llama, gemm_epilogues="swiglu=nope")
    assert Config.from_kwargs(tiny_llama).runner_config.gemm_epilogues == ""  # default: today's path


def test_greedy_outputs_identical_with_epilogues_on_and_off(tiny_model):
    """The fused model path (residual stream through the projections' epilogues, SwiGLU beside gate/up)
    gives the same greedy tokens as today's (fp32 on CPU)."""
    prompts = make_prompts()
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # fp32 (the Triton GEMM's fp32 dots are exact), eager: a decode graph captured before the switch would
    # replay the old path (the runner sets the epilogues before it captures)
    # two engines in one process: a fixed KV pool (profiling would leave the second one no memory on a GPU)
    kw = dict(dtype="float32", attention_backend="triton", enforce_eager=True,
              num_kvcache_blocks=64) if torch.cuda.is_available() else {}
    llm = LLM(tiny_model, block_size=16, **kw)
    model = llm.engine.model_runner.model
    off = [o.output_token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert configure_gemm_epilogues(model, "swiglu=triton,residual=cublas") == {"swiglu": "triton",
                                                                                "residual": "cublas"}
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    assert layers and all(m.residual_impl == "cublas" for m in layers)
    assert all(m.swiglu_impl == "triton" for m in model.modules() if isinstance(m, MLP))
    llm2 = LLM(tiny_model, block_size=16, **kw)
    configure_gemm_epilogues(llm2.engine.model_runner.model, "swiglu=triton,residual=cublas")
    on = [o.output_token_ids for o in llm2.generate(prompts, sp, use_tqdm=False)]
    assert on == off
    configure_gemm_epilogues(llm2.engine.model_runner.model, "")  # back to today's path
    assert all(m.residual_impl is None for m in llm2.engine.model_runner.model.modules()
               if isinstance(m, DecoderLayer))


def test_llm_applies_gemm_epilogues_at_construction(tiny_llama):
    """The engine field reaches the model: LLM(..., gemm_epilogues=...) sets every layer's impl (before any decode
    graph is captured), and the default leaves today's path."""
    model = LLM(tiny_llama, block_size=16, num_kvcache_blocks=16, device="cpu",
                gemm_epilogues="swiglu=triton").engine.model_runner.model
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert mlps and all(m.swiglu_impl == "triton" and m.residual_impl is None for m in mlps)
    model = LLM(tiny_llama, block_size=16, num_kvcache_blocks=16, device="cpu",
                gemm_epilogues="residual=cublas").engine.model_runner.model
    assert all(m.residual_impl == "cublas" for m in model.modules() if isinstance(m, DecoderLayer))
    model = LLM(tiny_llama, block_size=16, num_kvcache_blocks=16, device="cpu").engine.model_runner.model
    assert all(m.swiglu_impl is None for m in model.modules() if isinstance(m, MLP))


def test_an_impl_that_cannot_run_is_refused_naming_the_field(tiny_llama, monkeypatch):
    """quack that does not import, or the Triton (TMA) kernel below SM90, fail at construction with the field and
    the cause; they used to fail at the first step (an exception object called as a module, or a TMA launch)."""
    from flame_llm.kernels import gemm_epilogue

    broken = ImportError("No module named 'quack'")
    monkeypatch.setattr(gemm_epilogue, "quack_module", lambda: broken)
    with pytest.raises(ValueError, match=r"gemm_epilogues.*swiglu=quack.*ImportError: No module named 'quack'"):
        LLM(tiny_llama, block_size=16, num_kvcache_blocks=16, device="cpu", gemm_epilogues="swiglu=quack")
    model = LLM(tiny_llama, block_size=16, num_kvcache_blocks=16, device="cpu").engine.model_runner.model
    with pytest.raises(ValueError, match="gemm_epilogues.*residual=quack"):
        configure_gemm_epilogues(model, "residual=quack")
    # triton: fine on CPU (the torch composition), refused on a CUDA device below SM90
    assert epilogue_unavailable_reason("triton", torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "9.0 (TMA); this device is 8.0" in epilogue_unavailable_reason("triton", torch.device("cuda"))
    assert epilogue_unavailable_reason("cublas", torch.device("cuda")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert epilogue_unavailable_reason("triton", torch.device("cuda")) is None


@pytest.mark.skipif(not isinstance(quack_module(), Exception), reason="quack-kernels imports here")
def test_quack_without_quack_installed_is_refused():
    model = MLP(type("C", (), dict(hidden_size=8, intermediate_size=16))())
    with pytest.raises(ValueError, match="gemm_epilogues.*quack-kernels does not import"):
        configure_gemm_epilogues(model, "swiglu=quack")
