"""Producers that write a projection's input as e4m3 + per-token scales (quantization fp8 with fp8_fused_quant):
residual-add + RMSNorm (feeding qkv_proj and gate_up_proj) and SiLU(gate) * up (feeding down_proj), one launch
each instead of the producer's launch, a bf16 round trip through memory and kernels/fp8_quant.py's launch.

Each rounds exactly where the unfused chain rounds (kernels/fused.py's bf16 output, then per_token_quant's
amax / FP8_MAX floored at MIN_SCALE and x / scale clamped to ±FP8_MAX), so on one device the values and scales
equal the unfused path's. The residual sum stays in the model dtype, as in kernels/fused.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flame_llm.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Activation
from flame_llm.kernels.fused import add_rmsnorm_row

SILU_ONE_PASS_MAX = 16384  # SiLU-mul rows up to this width stay in registers (Llama-3.1-8B: 14,336)


@triton.jit
def _quant_store(y, q_ptr, s_ptr, row, cols, mask, N, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Scale of the row y (float32, masked lanes 0) and y / scale as e4m3."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row, scale)
    q = tl.minimum(tl.maximum(y / scale, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * N + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rmsnorm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, N, eps, HAS_RES: tl.constexpr,
                              FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    # the unfused path's rounding: the norm's output in the model dtype, then quantized
    out = add_rmsnorm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, cols, mask, N, eps, HAS_RES).to(tl.float32)
    _quant_store(out, q_ptr, s_ptr, row, cols, mask, N, FP8_MAX, MIN_SCALE)


def add_rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                      ) -> Fp8Activation | tuple[Fp8Activation, torch.Tensor]:
    """RMSNorm(x + residual) * weight as e4m3 + per-token scales; with a residual, (that, x + residual)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    m = x2.shape[0]
    q = torch.empty(m, n, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    warps = 4 if block <= 2048 else 8
    out = Fp8Activation(q, s, x.dtype)
    if residual is None:
        if m:
            _add_rmsnorm_quant_kernel[(m,)](x2, x2, weight, q, s, x2, n, eps, HAS_RES=False, FP8_MAX=FP8_MAX,
                                            MIN_SCALE=MIN_SCALE, BLOCK=block, num_warps=warps)
        return out
    r2 = residual.reshape(-1, n).contiguous()
    res_out = torch.empty_like(x2)
    if m:
        _add_rmsnorm_quant_kernel[(m,)](x2, r2, weight, q, s, res_out, n, eps, HAS_RES=True, FP8_MAX=FP8_MAX,
                                        MIN_SCALE=MIN_SCALE, BLOCK=block, num_warps=warps)
    return out, res_out.view(residual.shape)


@triton.jit
def _silu_mul_block(x_ptr, row, cols, mask, N):
    """silu(gate) * up of the columns `cols` of a row, rounded as kernels/fused.py rounds it, in float32."""
    g = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, N, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                           BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:  # the whole row in registers
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        _quant_store(_silu_mul_block(x_ptr, row, cols, mask, N), q_ptr, s_ptr, row, cols, mask, N, FP8_MAX,
                     MIN_SCALE)
    else:  # amax first, then the row again from L2 (as kernels/fp8_quant.py)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for off in range(0, N, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_silu_mul_block(x_ptr, row, cols, cols < N, N)))
        scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
        tl.store(s_ptr + row, scale)
        for off in range(0, N, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            y = _silu_mul_block(x_ptr, row, cols, cols < N, N)
            q = tl.minimum(tl.maximum(y / scale, -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + row * N + cols, q.to(q_ptr.dtype.element_ty), mask=cols < N)


def silu_mul_quant(x: torch.Tensor, one_pass_max: int = SILU_ONE_PASS_MAX) -> Fp8Activation:
    """x [..., 2N] = [gate | up] -> silu(gate) * up as e4m3 [M, N] + per-token scales [M, 1]."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n).contiguous()
    m = x2.shape[0]
    q = torch.empty(m, n, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    one_pass = n <= one_pass_max
    block = triton.next_power_of_2(n) if one_pass else 2048
    if m:
        _silu_mul_quant_kernel[(m,)](x2, q, s, n, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=block,
                                     ONE_PASS=one_pass, num_warps=16 if block > 4096 else (8 if block > 1024 else 4))
    return Fp8Activation(q, s, x.dtype)
