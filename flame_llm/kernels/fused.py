"""Fused Triton kernels for the small per-layer ops (one launch each instead of five to ten):
residual-add + RMSNorm, neox RoPE in place on q and k, and SiLU(gate) * up.

Each rounds where the torch path rounds (the residual sum and the normalized value are rounded to
the activation dtype before the weight multiply), so bf16 outputs track the torch path closely."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flame_llm.kernels.triton_kernels import _jit


@triton.jit
def add_rmsnorm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, cols, mask, N, eps, HAS_RES: tl.constexpr):
    """One row's RMSNorm(x + residual) * weight in x's dtype (x + residual stored to res_out_ptr): the body of
    _add_rmsnorm_kernel and of fp8_fused's quantizing variant."""
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * N + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * N + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, N, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    out = add_rmsnorm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, cols, mask, N, eps, HAS_RES)
    tl.store(out_ptr + row * N + cols, out, mask=mask)


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x + residual) * weight; returns (out, x + residual) with a residual, else out."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    n_rows, n = x2.shape
    out = torch.empty_like(x2)
    block = triton.next_power_of_2(n)
    if residual is None:
        _add_rmsnorm_kernel[(n_rows,)](x2, x2, weight, out, out, n, eps, HAS_RES=False, BLOCK=block)
        return out.view(shape)
    r2 = residual.reshape(-1, n).contiguous()
    res_out = torch.empty_like(x2)
    _add_rmsnorm_kernel[(n_rows,)](x2, r2, weight, out, res_out, n, eps, HAS_RES=True, BLOCK=block)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _rope_rows(x_ptr, t, pos, cache_ptr, stride_t, stride_h, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    d = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * 2 * HALF + d)
    sin = tl.load(cache_ptr + pos * 2 * HALF + HALF + d)
    h = tl.arange(0, BLOCK_H)
    hmask = h < num_heads
    base = x_ptr + t * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(base, mask=hmask[:, None], other=0.0)
    x2 = tl.load(base + HALF, mask=hmask[:, None], other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base, (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype), mask=hmask[:, None])
    tl.store(base + HALF, (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype), mask=hmask[:, None])


@_jit
def _rope_qk_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h,
                    num_q_heads, num_k_heads, HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    if tl.program_id(1) == 0:
        _rope_rows(q_ptr, t, pos, cache_ptr, q_stride_t, q_stride_h, num_q_heads, HALF, BLOCK_Q)
    else:
        _rope_rows(k_ptr, t, pos, cache_ptr, k_stride_t, k_stride_h, num_k_heads, HALF, BLOCK_K)


def rope_qk_inplace(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place in one launch; cache [max_pos, D] float32."""
    t, hq, hd = q.shape
    hk = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and triton.next_power_of_2(hd) == hd
    if t:
        _rope_qk_kernel[(t, 2)](q, k, positions, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                hq, hk, HALF=hd // 2, BLOCK_Q=triton.next_power_of_2(hq),
                                BLOCK_K=triton.next_power_of_2(hk))
    return q, k


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * N + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2N] = [gate | up] -> silu(gate) * up [..., N]."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    if x2.shape[0]:
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, n, BLOCK=block)
    return out.view(*x.shape[:-1], n)
