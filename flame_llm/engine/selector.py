"""What a ModelRunner runs on: its device, its dtype and its attention backend ("auto" resolved to the fastest
one this machine has), each checked here at startup rather than at the first step that needs it."""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"config field 'device' is {name!r} but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The model_config dtype; "auto": bfloat16 on CUDA, float32 elsewhere."""
    return _DTYPES[name if name != "auto" else ("bfloat16" if device.type == "cuda" else "float32")]


def resolve_backend(name: str, device: torch.device, block_size: int, dtype: torch.dtype, head_dim: int,
                    kv_cache_dtype: str = "auto") -> str:
    """The attention backend to use: `name`, or for "auto" the fastest one this machine has; ValueError when
    `name` cannot run here (checked now, not at the first step). kv_cache_dtype "fp8": e4m3 K/V, which our Triton
    kernel and the torch path read; FA4 (as our fa4_backend calls it, bf16/fp16 paged K/V) and flash-attn do not:
    "auto" picks triton on CUDA, naming them is an error."""
    if kv_cache_dtype == "fp8":
        if name in ("fa4", "flash_attn"):
            raise ValueError(f"engine field 'kv_cache_dtype' 'fp8' needs attention_backend 'auto', 'triton' or "
                             f"'torch' (e4m3 K/V are read by our Triton kernel and the torch path); got {name!r}")
        if name == "auto":
            name = "triton" if device.type == "cuda" else "torch"
            logger.info("attention: kv_cache_dtype fp8: %s (FA4 takes no FP8 K/V)", name)
    if name == "flash_attn" and block_size % 256:
        raise ValueError(f"attention_backend 'flash_attn' needs block_size % 256 == 0; got {block_size}")
    if name == "fa4":
        from flame_llm.kernels.fa4_backend import fa4_unavailable_reason
        reason = fa4_unavailable_reason(device, dtype, head_dim)
        if reason is not None:
            raise ValueError(f"attention_backend 'fa4' cannot run here: {reason}")
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    from flame_llm.kernels.fa4_backend import fa4_unavailable_reason
    reason = fa4_unavailable_reason(device, dtype, head_dim)
    if reason is None:
        return "fa4"
    logger.info("attention: flash-attn-4 not used (%s)", reason)
    from flame_llm.kernels.flash_backend import FLASH_ATTN_AVAILABLE
    return "flash_attn" if FLASH_ATTN_AVAILABLE and block_size % 256 == 0 else "triton"


BACKEND_STEPS = {  # which steps run on which kernels, for the ModelRunner's startup log line
    "fa4": "prefill and mixed steps on flash-attn-4 (paged varlen), decode-only steps on our Triton kernel",
    "triton": "every step on our Triton paged-attention kernel",
    "flash_attn": "every step on flash-attn (FA2, paged)",
    "torch": "every step on the torch reference path",
}
