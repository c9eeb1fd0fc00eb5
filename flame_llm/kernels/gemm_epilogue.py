"""GEMMs with the memory-bound op after them fused into the epilogue, so the wide intermediate never goes
through device memory:

  swiglu:   out[M, I] = silu(x @ Wg.T) * (x @ Wu.T), W = [Wg; Wu] as MergedLinear stores it ([2I, K]);
  residual: out[M, N] = x @ W.T + residual (the o / down projection plus the residual stream).

Implementations (Config.gemm_epilogues picks; bench/fusion_probe.py measures each against cuBLAS plus our
separate kernels): "cublas" (residual only: torch.addmm with beta 1, cuBLAS reads C in its epilogue),
"triton" (a persistent TMA matmul below) and "quack" (quack-kernels' CuTe-DSL Hopper GEMMs, gemm_act with
the gated swiglu epilogue and gemm_add). On CPU every one is the torch composition (the reference).

The Triton kernel: a persistent grid of one program per SM walks the output tiles in grouped order; A and B
tiles come through TMA descriptors (host-built), fp32 accumulation. For swiglu a tile holds BLOCK_N gate
and BLOCK_N up columns (two accumulators over the same A tile), so no weight re-layout is needed. M (the
step's token count) is not specialised: one compile serves every step."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

EPI_NONE, EPI_SWIGLU, EPI_RESIDUAL = 0, 1, 2
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages); swiglu's BLOCK_N is per half
CONFIGS = {EPI_NONE: (128, 256, 64, 8, 8, 3), EPI_SWIGLU: (128, 128, 64, 8, 8, 3),
           EPI_RESIDUAL: (128, 256, 64, 8, 8, 3)}


@triton.jit(do_not_specialize=["M"])
def _gemm_epilogue_kernel(a_desc, b_desc, out_ptr, res_ptr, M, N, K, stride_om, stride_rm, N_UP,
                          EPI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    per_group = GROUP_M * num_n
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGS):
        group = tile // per_group
        first_m = group * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % size_m
        pid_n = (tile % per_group) // size_m
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if EPI == 1:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k])
            b = b_desc.load([off_n, k])
            acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
            if EPI == 1:
                b_up = b_desc.load([N_UP + off_n, k])
                acc_up = tl.dot(a, b_up.T, acc_up, input_precision=DOT_PRECISION)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        rows64 = rows.to(tl.int64)
        if EPI == 1:
            # rounded where the unfused path rounds: gate and up to the dtype, silu(gate) too
            g = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            u = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
            y = s * u
        elif EPI == 2:
            r = tl.load(res_ptr + rows64[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
            y = acc + r.to(tl.float32)
        else:
            y = acc
        tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def triton_gemm(x: torch.Tensor, weight: torch.Tensor, epi: int = EPI_NONE, residual: torch.Tensor | None = None,
                config: tuple | None = None, num_progs: int | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T with the epilogue `epi` (EPI_SWIGLU: weight is [2I, K], out [M, I];
    EPI_RESIDUAL: + residual [M, N])."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
    m, k = x.shape
    n = weight.shape[0] // 2 if epi == EPI_SWIGLU else weight.shape[0]
    bm, bn, bk, gm, warps, stages = config or CONFIGS[epi]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if epi == EPI_RESIDUAL:
        assert residual is not None and residual.shape == (m, n) and residual.stride(1) == 1
    else:
        residual = out
    if m == 0:
        return out
    a_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if num_progs is None:
        num_progs = _num_sms(x.device.index or 0) if x.is_cuda else 4
    _gemm_epilogue_kernel[(min(num_progs, tiles),)](
        a_desc, b_desc, out, residual, m, n, k, out.stride(0), residual.stride(0), n,
        EPI=epi, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, NUM_PROGS=num_progs,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 stays exact (tests)
        num_warps=warps, num_stages=stages)
    return out


# ---- quack-kernels (CuTe DSL, Hopper/Blackwell); imported only when asked for -------------------
@functools.cache
def quack_module():
    """quack.gemm_interface, or the exception importing it raised."""
    try:
        import quack.gemm_interface as gi
        return gi
    except Exception as e:  # ImportError, or the CUTLASS DSL failing to load
        return e


def quack_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ Wg.T) * (x @ Wu.T) through quack's gated GEMM; W = [Wg; Wu] read as concatenated halves."""
    gi = quack_module()
    _, post = gi.gemm_act(x, weight.T, activation="swiglu", store_preact=False, tuned=False,
                          concat_layout=("B",))
    return post


def quack_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """x @ W.T + residual through quack's gemm_add (C read in the epilogue)."""
    return quack_module().gemm_add(x, weight.T, residual, tuned=False)


TMA_CAPABILITY = (9, 0)  # the Triton kernel's TensorDescriptor loads are TMA: Hopper and newer


def epilogue_unavailable_reason(impl: str, device: torch.device) -> str | None:
    """Why `impl` cannot run on `device` (None when it can). Off CUDA every impl runs as the torch composition,
    so only quack's import is checked there (asking for quack on a machine without it is a config error)."""
    if impl == "quack":
        gi = quack_module()
        if isinstance(gi, Exception):
            return f"quack-kernels does not import: {type(gi).__name__}: {gi}"
    if impl == "triton" and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < TMA_CAPABILITY:
            return (f"the Triton kernel needs CUDA compute capability >= {TMA_CAPABILITY[0]}.{TMA_CAPABILITY[1]} "
                    f"(TMA); this device is {cap[0]}.{cap[1]}")
    return None


# ---- the dispatch the layers call ------------------------------------------------------------------
def swiglu_linear(x: torch.Tensor, weight: torch.Tensor, impl: str) -> torch.Tensor:
    """silu(gate) * up of the merged gate/up projection of x [..., K]; torch composition off CUDA."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x.is_cuda or impl == "torch":
        gate, up = F.linear(x2, weight).chunk(2, -1)
        out = F.silu(gate) * up
    elif impl == "triton":
        out = triton_gemm(x2.contiguous(), weight, EPI_SWIGLU)
    elif impl == "quack":
        out = quack_swiglu(x2.contiguous(), weight)
    else:
        raise ValueError(f"swiglu epilogue implementation {impl!r} is not one of 'torch', 'triton', 'quack'")
    return out.view(*shape[:-1], out.shape[-1])


def residual_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, impl: str) -> torch.Tensor:
    """x @ W.T + residual; "cublas" is torch.addmm (beta 1), which also runs on CPU."""
    shape = residual.shape
    x2, r2 = x.reshape(-1, x.shape[-1]), residual.reshape(-1, shape[-1])
    if impl == "cublas" or not x.is_cuda:
        out = torch.addmm(r2, x2, weight.T)
    elif impl == "triton":
        out = triton_gemm(x2.contiguous(), weight, EPI_RESIDUAL, r2.contiguous())
    elif impl == "quack":
        out = quack_residual(x2.contiguous(), weight, r2.contiguous())
    else:
        raise ValueError(f"residual epilogue implementation {impl!r} is not one of 'cublas', 'triton', 'quack'")
    return out.view(shape)
