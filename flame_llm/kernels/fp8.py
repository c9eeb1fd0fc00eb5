"""FP8 (e4m3) W8A8 math in torch: per-output-channel weight quantization, dynamic per-token activation
quantization and the projection itself (fp8_linear). No Triton import here (the CPU tests set TRITON_INTERPRET
before their first Triton import; this module is imported with the engine).

On CUDA the activations are quantized in one Triton launch (kernels/fp8_quant.py: each program reads its row's
amax, writes the row's scale, amax / 448 floored at MIN_SCALE, and the row cast to e4m3, x / scale clamped to
±448) and the GEMM is one `torch._scaled_mm` with row-wise scales (cuBLASLt): no host syncs, shapes fixed by the
input, safe inside CUDA graphs. Elsewhere the reference path (per_token_quant_ref, the same arithmetic in torch)
quantizes, dequantizes and multiplies in float32."""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor: an all-zero row gets a finite scale


def fp8_unavailable_reason(device: torch.device) -> str | None:
    """Why the FP8 GEMM cannot run on `device` (None: it can). CPU runs the reference path."""
    if device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(device)
    if cap < (9, 0):  # Ada (8.9) has FP8 tensor cores, but torch's row-wise-scaled _scaled_mm is built for 9.0+
        return f"FP8 GEMMs with row-wise scales need compute capability >= 9.0 (Hopper); this GPU has {cap[0]}.{cap[1]}"
    return None


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8 [N, K], scale [N] float32), one scale per output channel (row): w ≈ w_fp8 * scale[:, None]."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def per_token_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of kernels.fp8_quant (the Triton kernel): (x_fp8 [M, K], scales [M, 1] float32)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 [M, K], scales [M, 1] float32) of a 2-D x: the Triton kernel on CUDA, the reference elsewhere."""
    if x.is_cuda:
        from flame_llm.kernels.fp8_quant import per_token_quant_into
        x = x if x.stride(-1) == 1 else x.contiguous()
        q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
        s = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
        per_token_quant_into(x, q, s, FP8_MAX, MIN_SCALE)
        return q, s
    return per_token_quant_ref(x)


@dataclass(slots=True, frozen=True)
class Fp8Activation:
    """A projection input already quantized by its producer (fp8_fused_quant: RMSNorm or SiLU-mul wrote it,
    kernels/fp8_fused.py): values e4m3 [M, K], scales float32 [M, 1] (x ≈ values * scales), dtype: the model
    dtype the projection's output takes."""
    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def quantize_activation(x: torch.Tensor) -> Fp8Activation:
    """x [M, K] quantized per token (the unfused producer's path: its output, then per_token_quant)."""
    q, s = per_token_quant(x.reshape(-1, x.shape[-1]))
    return Fp8Activation(q, s, x.dtype)


def fp8_linear(x: torch.Tensor | Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ (weight * weight_scale).T + bias with x quantized per token (here, or by its producer: an
    Fp8Activation); y in x's dtype. weight: e4m3 [N, K]; weight_scale: float32 [N]."""
    shape, dtype = x.shape, x.dtype
    if isinstance(x, Fp8Activation):
        xq, xs = x.values, x.scales
    else:
        xq, xs = per_token_quant(x.reshape(-1, shape[-1]))
    if xq.shape[0] == 0:  # no rows: no GEMM (cuBLASLt may refuse M = 0)
        return torch.empty(*shape[:-1], weight.shape[0], dtype=dtype, device=xq.device)
    if xq.is_cuda:
        # row-wise scaling writes bf16 only (cuBLASLt); a float32/float16 model gets it cast
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16)
        y = y if dtype == torch.bfloat16 else y.to(dtype)
    else:  # reference: dequantize both, multiply in float32
        y = ((xq.float() * xs) @ (weight.float() * weight_scale[:, None]).t()).to(dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])


def fp8_small_m(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                ) -> torch.Tensor:
    """W8A16 for steps of few rows (fp8_small_m_gemv): x as it is times the e4m3 weights widened, no activation
    quantization; kernels/fp8_gemv.py on CUDA, the dequantized weights' product elsewhere. y in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.is_cuda:
        from flame_llm.kernels.fp8_gemv import fp8_small_m_linear
        y = fp8_small_m_linear(x2 if x2.stride(1) == 1 else x2.contiguous(), weight, weight_scale)
    else:
        y = (x2.float() @ (weight.float() * weight_scale[:, None]).t()).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])
