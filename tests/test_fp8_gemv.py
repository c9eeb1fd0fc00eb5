"""The small-M FP8-weight kernel (flame_llm/kernels/fp8_gemv.py) against the dequantized weights' product, with
and without split-K, under Triton's interpreter on CPU (fp16: the interpreter's bf16 dot is wrong) and on a GPU
in bf16."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import pytest  # noqa: E402

from flame_llm.kernels.fp8_gemv import fp8_small_m_linear, pick_config  # noqa: E402


def _case(m, n, k, dtype, device):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = torch.randn(n, k, generator=g) / k**0.5
    s = w.abs().amax(1) / 448
    wq = (w / s[:, None]).to(torch.float8_e4m3fn).to(device)
    ref = x.float() @ (wq.float() * s.to(device)[:, None]).t()
    return x, wq, s.float().to(device), ref


@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 64, 256, (16, 32, 128, 1)),
    (5, 96, 512, (16, 32, 128, 2)),   # split-K through the fp32 buffer
    (3, 160, 384, (16, 64, 128, 1)),  # N and K not multiples of the tiles
    (16, 128, 512, (16, 64, 128, 4)),
])
def test_small_m_matches_dequantized(m, n, k, cfg):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, wq, s, ref = _case(m, n, k, torch.float16, device)
    out = fp8_small_m_linear(x, wq, s, cfg)
    assert out.shape == (m, n) and out.dtype == torch.float16
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-3


def test_rows_over_the_tile_are_refused():
    x, wq, s, _ = _case(20, 32, 128, torch.float16, "cpu")
    with pytest.raises(AssertionError, match="exceed BLOCK_M"):
        fp8_small_m_linear(x, wq, s, (16, 32, 128, 1))


def test_pick_config_fills_the_gpu():
    bm, bn, bk, split = pick_config(1, 4096, 14336)
    assert bm == 16 and (4096 // bn) * split >= 264


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_small_m_on_gpu_bf16():
    for m in (1, 8, 16):
        x, wq, s, ref = _case(m, 6144, 4096, torch.bfloat16, "cuda")
        out = fp8_small_m_linear(x, wq, s, (16, 32, 256, 2))
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
