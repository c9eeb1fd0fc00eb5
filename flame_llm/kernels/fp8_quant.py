"""The Triton kernel of dynamic per-token FP8 (e4m3) activation quantization, in one launch: each program reads
its row's amax, writes the row's scale (amax / FP8_MAX, floored at MIN_SCALE) and the row cast to e4m3 (x / scale,
clamped to ±FP8_MAX). No host syncs, shapes from the input: capturable in CUDA graphs. kernels/fp8.py calls it on
CUDA (per_token_quant) and holds the torch reference and the constants."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * K
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(0, K, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row, scale)
    for off in range(0, K, BLOCK):  # the row again, from L2: K is at most a few tens of KB
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)


def per_token_quant_into(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, fp8_max: float, min_scale: float,
                         ) -> None:
    """Quantize a 2-D x whose rows are contiguous into q [M, K] (e4m3, contiguous) and s [M, 1] (float32):
    x ≈ q * s (kernels.fp8.per_token_quant allocates them and passes its constants)."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    m, k = x.shape
    assert q.shape == (m, k) and q.is_contiguous() and s.shape == (m, 1) and s.dtype == torch.float32
    if m:
        block = min(triton.next_power_of_2(k), 2048)
        _per_token_quant_kernel[(m,)](x, q, s, k, x.stride(0), FP8_MAX=fp8_max, MIN_SCALE=min_scale, BLOCK=block,
                                      num_warps=4 if block <= 1024 else 8)
