"""Small model building blocks: fused projections with HF weight loaders, RMSNorm, SiLU-mul, RoPE."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flame_llm.kernels.fp8 import Fp8Activation, fp8_linear, fp8_small_m, quantize_activation


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"tensor shape {tuple(loaded.shape)} does not match parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        self.register_parameter("weight_scale", None)  # quantization "fp8": float32 [N] (layers/fp8.py)
        self.small_m_rows = 0  # fp8_small_m_gemv: bf16 inputs of at most this many rows run W8A16

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if self.weight_scale is not None:  # x: bf16, or e4m3 + scales from its producer (fp8_out)
            if not isinstance(x, Fp8Activation) and 0 < _rows(x) <= self.small_m_rows:
                return fp8_small_m(x, self.weight, self.weight_scale, self.bias)
            return fp8_linear(x, self.weight, self.weight_scale, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several HF projections stacked on the output dim (qkv_proj from q/k/v, gate_up_proj from gate/up)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (off, size)
            off += size
        self.weight.weight_loader = self.load_shard
        if self.bias is not None:
            self.bias.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert shard_id in self.shard_offsets, shard_id
        off, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, off, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shard {shard_id!r}: tensor shape {tuple(loaded.shape)} does not match "
                             f"expected {tuple(target.shape)}")
        target.copy_(loaded)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.fused = False  # set by the ModelRunner on CUDA: one Triton launch instead of several
        self.fp8_out = False  # quantization fp8 + fp8_fused_quant: the output is an Fp8Activation (layers/fp8.py)
        self.fp8_bf16_rows = 0  # fp8_small_m_gemv: outputs of at most this many rows stay bf16 (W8A16 reads them)
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple:
        if self.fp8_out and _rows(x) > self.fp8_bf16_rows:
            return self._forward_fp8(x, residual)
        if self.fused:
            from flame_llm.kernels.fused import add_rmsnorm
            return add_rmsnorm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _forward_fp8(self, x: torch.Tensor, residual: torch.Tensor | None) -> Fp8Activation | tuple:
        """The output as its projection's e4m3 input + per-token scales (fp8_fused_quant)."""
        if self.fused:  # norm and quantization in one launch
            from flame_llm.kernels.fp8_fused import add_rmsnorm_quant
            return add_rmsnorm_quant(x, self.weight, self.eps, residual)
        if residual is None:  # the reference: the torch norm, then its output quantized
            return quantize_activation(self._norm(x))
        residual = x + residual
        return quantize_activation(self._norm(residual)), residual


class SiluAndMul(nn.Module):
    fused = False
    fp8_out = False  # as RMSNorm.fp8_out
    fp8_bf16_rows = 0  # as RMSNorm.fp8_bf16_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor | Fp8Activation:
        if self.fp8_out and _rows(x) > self.fp8_bf16_rows:
            return self._forward_fp8(x)
        if self.fused:
            from flame_llm.kernels.fused import silu_mul
            return silu_mul(x)
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up

    def _forward_fp8(self, x: torch.Tensor) -> Fp8Activation:
        """The output as down_proj's e4m3 input + per-token scales (fp8_fused_quant)."""
        if self.fused:
            from flame_llm.kernels.fp8_fused import silu_mul_quant
            return silu_mul_quant(x)
        gate, up = x.chunk(2, -1)
        return quantize_activation(F.silu(gate) * up)


def rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"rope_type {kind!r} is not supported; supported: 'default', 'llama3'")
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (HF's rotate_half) with a precomputed cos/sin cache indexed by position."""

    def __init__(self, head_dim: int, max_position: int, params: dict) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, params)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.fused = False

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:  # rotates q and k in place
            from flame_llm.kernels.fused import rope_qk_inplace
            return rope_qk_inplace(q, k, positions, self.cos_sin_cache)
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, head_dim]; cos/sin [T, head_dim/2]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
