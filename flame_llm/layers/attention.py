from __future__ import annotations

import torch
from torch import nn

from flame_llm.kernels.metadata import get_context
from flame_llm.kernels.torch_attention import (
    dense_causal_attention,
    paged_decode_attention,
    store_kvcache,
    torch_attention_forward,
)


def _backend_fn(name: str):
    if name == "torch":
        return torch_attention_forward
    if name == "triton":
        from flame_llm.kernels.triton_attention import triton_attention_forward
        return triton_attention_forward
    if name == "flash_attn":
        from flame_llm.kernels.flash_backend import flash_attention_forward
        return flash_attention_forward
    if name == "fa4":
        from flame_llm.kernels.fa4_backend import fa4_attention_forward
        return fa4_attention_forward
    raise ValueError(f"attention_backend {name!r} is not one of 'torch', 'triton', 'flash_attn', 'fa4'")


class Attention(nn.Module):
    """Stores the step's K/V in this layer's paged cache and attends over it.

    k_cache/v_cache are views into the runner's one KV tensor, bound after the memory profile."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = "torch"
        self._fn = torch_attention_forward

    def set_backend(self, name: str) -> None:
        self.backend = name
        self._fn = _backend_fn(name)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_context()
        if self.k_cache.numel() == 0:  # memory-profile run before the cache exists
            return dense_causal_attention(q, k, v, meta.cu_seqlens_q, self.scale)
        if meta.fixed_launch is not None:  # a step in a mixed-step CUDA graph: our Triton kernel, any backend
            from flame_llm.kernels.triton_attention import fixed_launch_attention
            return fixed_launch_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self._fn(q, k, v, self.k_cache, self.v_cache, meta, self.scale)

    def forward_kept(self, q_kept: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """prune_last_layer: store every row's k/v [T, Hkv, D] at the step's slot_mapping, then attend only
        q_kept [S, H, D], the step's sampled rows (meta.kept: each the last query of its sequence, so a decode
        query over its seq_len keys). Our Triton decode kernel on every backend but torch (its variants are
        compiled at startup; FA4's would compile just in time; on CPU "triton" runs it under the interpreter)."""
        meta = get_context()
        assert self.k_cache.numel() > 0 and meta.fixed_launch is None, "eager steps with a KV cache only"
        triton = self.backend != "torch"
        if triton:
            from flame_llm.kernels.triton_attention import paged_attention_triton, store_kv
            store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        else:
            store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if q_kept.shape[0] == 0:
            return q_kept
        kept = meta.kept
        assert kept is not None and kept.seq_lens.shape[0] == q_kept.shape[0], "one kept row per sampling sequence"
        if triton:
            return paged_attention_triton(q_kept, self.k_cache, self.v_cache, kept, self.scale)
        return paged_decode_attention(q_kept, self.k_cache, self.v_cache, kept.seq_lens, kept.block_tables,
                                      self.scale)
