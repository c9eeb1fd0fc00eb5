"""W8A8 FP8 projections (ModelConfig.quantization = "fp8"): the decoder's Linear/MergedLinear get e4m3 weights
with one float32 scale per output channel (`weight_scale`), quantized from loaded bf16/dummy weights or read as
they are from an FP8 checkpoint; Linear.forward then runs kernels.fp8.fp8_linear (activations quantized
per token at run time). lm_head and the embeddings stay in the model dtype (as vLLM's fp8 leaves them)."""
from __future__ import annotations

import torch
from torch import nn

from flame_llm.kernels.fp8 import FP8_DTYPE, quantize_weight
from flame_llm.layers.layers import Linear


def fp8_linears(model: nn.Module) -> list[Linear]:
    """The decoder's projections (Linear and MergedLinear); lm_head and embeddings are other classes."""
    return [m for m in model.modules() if isinstance(m, Linear)]


def set_fp8_producers(model: nn.Module, fused_quant: bool, small_m: int = 0) -> int:
    """fused_quant (ModelConfig.fp8_fused_quant): each decoder layer's input_layernorm, post_attention_layernorm
    and SiLU-mul write their projection's input as an Fp8Activation (with fused ops on CUDA: one Triton launch,
    kernels/fp8_fused.py), so the projection skips its own quantization; off: bf16 outputs, as before.
    small_m (fp8_small_m_gemv; 0: off): inputs of at most that many rows stay bf16 and every projection runs them
    W8A16 (kernels/fp8_gemv.py). Returns how many producers it set."""
    producers = []
    for m in model.modules():
        if hasattr(m, "post_attention_layernorm"):  # a DecoderLayer (the final norm feeds lm_head: bf16)
            producers += [m.input_layernorm, m.post_attention_layernorm, m.mlp.act_fn]
    for p in producers:
        p.fp8_out, p.fp8_bf16_rows = fused_quant, small_m
    for m in fp8_linears(model):
        m.small_m_rows = small_m
    return len(producers)


def quantize_linear(m: Linear) -> None:
    """Replace a loaded bf16/fp32 projection's weight by e4m3 + per-channel scales, in place."""
    q, scale = quantize_weight(m.weight.data)
    m.weight = nn.Parameter(q, requires_grad=False)
    m.weight_scale = nn.Parameter(scale, requires_grad=False)


def quantize_model(model: nn.Module) -> int:
    """Quantize every decoder projection of a loaded model (dummy or bf16 weights); returns how many."""
    linears = fp8_linears(model)
    for m in linears:
        quantize_linear(m)
    return len(linears)


def prepare_fp8_checkpoint(model: nn.Module, block: tuple[int, int] | None) -> None:
    """Give every projection empty e4m3 weights and float32 scales that an FP8 checkpoint's tensors load into
    as they are (MergedLinear shards by row offset). block (HF "fp8" weight_block_size): the scale holds one
    value per [b0, b1] block until finish_fp8_checkpoint turns it into per-channel scales."""
    for m in fp8_linears(model):
        n, k = m.weight.shape
        shards = getattr(m, "shard_offsets", None) or {None: (0, n)}
        if block is not None:
            for name, (off, size) in shards.items():
                if off % block[0] or size % block[0]:
                    raise ValueError(f"quantization_config.weight_block_size {list(block)}: projection shard "
                                     f"{name or 'weight'} of {size} rows at row {off} is not whole blocks")
            scale_shape = (-(-n // block[0]), -(-k // block[1]))
        else:
            scale_shape = (n,)
        m.weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE, device=m.weight.device), requires_grad=False)
        m.weight.weight_loader = _fp8_weight_loader(m, shards)
        m.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device=m.weight.device),
                                      requires_grad=False)
        m.weight_scale.weight_loader = _scale_loader(shards, block)


def finish_fp8_checkpoint(model: nn.Module, block: tuple[int, int] | None) -> None:
    """Block-wise scales -> per-output-channel: each weight dequantized with its blocks' scales and quantized
    again per row (exact where a row's blocks share one scale; else each value moves by at most one e4m3 step)."""
    if block is None:
        return
    for m in fp8_linears(model):
        n, k = m.weight.shape
        s = m.weight_scale.data.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        q, scale = quantize_weight(m.weight.data.float() * s)
        m.weight = nn.Parameter(q, requires_grad=False)
        m.weight_scale = nn.Parameter(scale, requires_grad=False)


def _fp8_weight_loader(m: Linear, shards: dict):
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if loaded.dtype != FP8_DTYPE:
            raise ValueError(f"tensor is {loaded.dtype}, not float8_e4m3fn: FP8 checkpoints whose projections are "
                             "partly unquantized (quantization_config 'ignore' beyond lm_head) are not supported")
        off, size = shards[shard_id]
        target = param.data.narrow(0, off, size)
        if target.shape != loaded.shape:
            raise ValueError(f"tensor shape {tuple(loaded.shape)} does not match expected {tuple(target.shape)}")
        target.copy_(loaded)
    return load


def _scale_loader(shards: dict, block: tuple[int, int] | None):
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        off, size = shards[shard_id]
        if block is not None:
            target = param.data.narrow(0, off // block[0], size // block[0])
            if loaded.shape != target.shape:
                raise ValueError(f"block scale shape {tuple(loaded.shape)} does not match expected "
                                 f"{tuple(target.shape)} (weight_block_size {list(block)})")
            target.copy_(loaded)
            return
        target = param.data.narrow(0, off, size)
        flat = loaded.reshape(-1)
        if flat.numel() not in (1, size):  # per-tensor: one value; per-channel: [N] or [N, 1]
            raise ValueError(f"scale of shape {tuple(loaded.shape)} is neither per-tensor (1 value) nor "
                             f"per-channel ({size} values)")
        target.copy_(flat.expand(size) if flat.numel() == 1 else flat)
    return load
