"""Small-M linear layers on FP8 weights: bf16 activations x e4m3 weights (per-output-channel scales) -> bf16.

Decode steps have few rows (1-64), where a projection is a pass over its weights: FP8 weights halve the bytes,
but torch._scaled_mm's row-wise kernels at M <= 128 ran no faster than bf16 F.linear on the H200 (0.7-1.0x,
bench.engine.fp8_gemm_probe, 2026-12-04), and quantizing the activations per token costs more than the GEMM there. This
kernel reads the weight tile in e4m3, widens it to bf16 in registers and multiplies the bf16 activations as they
are (no activation quantization: W8A16 for these steps, exact up to the weights' own rounding), accumulating in
fp32 and scaling each output column once at the end.

Program = (BLOCK_N output columns, one of SPLIT_K slices of K). With SPLIT_K > 1 the slices add into an fp32
buffer (atomics), which `fp8_small_m_linear` then scales and casts: few columns per program keep all SMs busy at
N = 4,096 without a second launch per slice.

Measured on the H200 (bench/RESULTS.md, session 16): 1.07-1.34x bf16 F.linear per projection at M <= 16 (a whole
32-layer step 1.12-1.20x), behind bf16 at 32-64 rows; a transposed form (out^T = W x^T) won no shape and was
dropped. Not wired into the engine: bench.engine.fp8_gemm_probe times it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per, K), BLOCK_K):
        kk = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + kk[:, None],
                    mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc)
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
        tl.store(out_ptrs, (acc * scale[None, :]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)


def pick_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) for a step of m rows: enough programs to cover ~132 SMs twice."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 32 if n >= 4096 else 16
    block_k = 256
    split = 1
    while (n // block_n) * split < 264 and k // (block_k * split * 2) >= 4:
        split *= 2
    return block_m, block_n, block_k, split


def fp8_small_m_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       config: tuple[int, int, int, int] | None = None, num_warps: int = 4,
                       num_stages: int = 4) -> torch.Tensor:
    """x (M, K) bf16, weight (N, K) e4m3 row-major, weight_scale (N,) fp32 -> (M, N) in x's dtype."""
    assert x.dim() == 2 and weight.dtype == torch.float8_e4m3fn and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1
    m, k = x.shape
    n = weight.shape[0]
    bm, bn, bk, split = config or pick_config(m, n, k)
    assert m <= bm, f"{m} rows exceed BLOCK_M {bm}: use the M-tiled path"
    grid = (triton.cdiv(n, bn), split)
    kernel = _w8a16_kernel
    if split == 1:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        kernel[grid](x, weight, weight_scale, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, num_warps=num_warps, num_stages=num_stages)
        return out
    acc = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    kernel[grid](x, weight, weight_scale, acc, m, n, k, x.stride(0), weight.stride(0), acc.stride(0),
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=num_warps, num_stages=num_stages)
    return (acc * weight_scale).to(x.dtype)
