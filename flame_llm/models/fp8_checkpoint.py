"""Weights for ModelConfig.quantization = "fp8": from an FP8 checkpoint as they are, or quantized at load from
bf16/dummy weights (layers/fp8.py).

Checkpoints are recognised by config.json's `quantization_config`:
- compressed-tensors (llm-compressor's FP8 / FP8-dynamic): `format` float-quantized or naive-quantized, one
  config group of 8-bit float weights with strategy "channel" or "tensor" (tensor `weight_scale`); activations
  dynamic per token, or static (their `input_scale` is not read: ours are quantized per token at run time).
- HF "fp8" (`quant_method: fp8`, e.g. Qwen's -FP8 models): `weight_block_size` [b0, b1] with `weight_scale_inv`
  one scale per block, turned into per-output-channel scales at load (layers.fp8.finish_fp8_checkpoint); without
  a block size, `weight_scale` per tensor or per channel.
Anything else is refused with an error naming the quantization_config field."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from flame_llm.kernels.fp8 import fp8_unavailable_reason
from flame_llm.layers.fp8 import finish_fp8_checkpoint, prepare_fp8_checkpoint, quantize_model
from flame_llm.models.loader import init_dummy, load_model

logger = logging.getLogger(__name__)
CT_FORMATS = ("float-quantized", "naive-quantized")
CT_WEIGHT_STRATEGIES = ("channel", "tensor")
# checkpoint tensors we do not read: static activation scales, KV-cache scales (kv_cache_dtype fp8 uses its own)
_SKIPPED = {".input_scale": None, ".k_scale": None, ".v_scale": None, ".kv_scale": None}


@dataclass(slots=True)
class Fp8Checkpoint:
    quant_method: str  # "compressed-tensors" | "fp8"
    scale_name: str  # the checkpoint's per-projection scale tensor suffix: "weight_scale" | "weight_scale_inv"
    block: tuple[int, int] | None = None  # HF fp8 weight_block_size

    @property
    def suffix_map(self) -> dict[str, str | None]:
        return {**_SKIPPED, f".{self.scale_name}": ".weight_scale"}


def _bad(field: str, value: object, limit: str) -> ValueError:
    return ValueError(f"config.json quantization_config.{field} must be {limit}; got {value!r}")


def fp8_checkpoint(hf_config) -> Fp8Checkpoint | None:
    """The FP8 layout config.json's quantization_config describes; None without one. ValueError names the field
    of a layout we cannot load."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise _bad("activation_scheme", qc.get("activation_scheme"), "'dynamic' or 'static'")
        block = qc.get("weight_block_size")
        if block is None:
            return Fp8Checkpoint("fp8", "weight_scale")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                              for b in block)):
            raise _bad("weight_block_size", block, "null or [rows, cols] of positive integers")
        return Fp8Checkpoint("fp8", "weight_scale_inv", (block[0], block[1]))
    raise _bad("quant_method", method, "'compressed-tensors' or 'fp8' (FP8 checkpoints; others are not supported)")


def _compressed_tensors(qc: dict) -> Fp8Checkpoint:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _bad("config_groups", sorted(groups), "one group (FP8 weights of every Linear)")
    (gname, group), = groups.items()
    fmt = group.get("format") or qc.get("format")
    if fmt not in CT_FORMATS:
        raise _bad("format", fmt, " or ".join(map(repr, CT_FORMATS)))
    w = group.get("weights") or {}
    where = f"config_groups.{gname}.weights"
    if w.get("num_bits") != 8 or w.get("type") != "float":
        raise _bad(f"{where}.type/num_bits", (w.get("type"), w.get("num_bits")), "8-bit 'float' (FP8)")
    if w.get("strategy") not in CT_WEIGHT_STRATEGIES:
        raise _bad(f"{where}.strategy", w.get("strategy"), " or ".join(map(repr, CT_WEIGHT_STRATEGIES)))
    if not w.get("symmetric", True) or w.get("dynamic"):
        raise _bad(f"{where}.symmetric/dynamic", (w.get("symmetric"), w.get("dynamic")), "symmetric, static")
    a = group.get("input_activations")
    if a is not None and (a.get("num_bits") != 8 or a.get("type") != "float"):
        raise _bad(f"config_groups.{gname}.input_activations", (a.get("type"), a.get("num_bits")),
                   "8-bit 'float' (W8A8 FP8) or null")
    return Fp8Checkpoint("compressed-tensors", "weight_scale")


def load_weights(model: nn.Module, model_config, device: torch.device) -> None:
    """Dummy or safetensors weights into `model` (built in the model dtype); with quantization "fp8" the decoder's
    projections end in e4m3 + per-channel scales. ValueError names the field: an FP8 checkpoint without
    quantization "fp8", a GPU without FP8 GEMMs."""
    mc = model_config
    ckpt = fp8_checkpoint(mc.hf_config) if mc.load_format != "dummy" else None
    if ckpt is not None and mc.quantization != "fp8":
        raise ValueError(f"engine field 'quantization': {mc.model!r} is an FP8 checkpoint "
                         f"(quantization_config.quant_method {ckpt.quant_method!r}); set quantization: fp8")
    if mc.quantization == "fp8":
        reason = fp8_unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"engine field 'quantization' 'fp8' cannot run here: {reason}")
    if ckpt is not None:
        prepare_fp8_checkpoint(model, ckpt.block)
        load_model(model, mc.model, ckpt.suffix_map)
        finish_fp8_checkpoint(model, ckpt.block)
        logger.info("FP8 checkpoint (%s%s) loaded as it is", ckpt.quant_method,
                    f", {list(ckpt.block)} blocks -> per-channel scales" if ckpt.block else "")
        return
    if mc.load_format == "dummy":
        init_dummy(model, mc.seed)
    else:
        load_model(model, mc.model)
    if mc.quantization == "fp8":
        n = quantize_model(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("quantization fp8: %d projections quantized to e4m3 with per-channel scales", n)
