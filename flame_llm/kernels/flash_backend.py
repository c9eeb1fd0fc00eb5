"""Optional fast path through flash-attn's paged kernels; imports cleanly when flash_attn is absent.

flash-attn reads the paged cache through block_table only for block sizes that are multiples of 256."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flame_llm.kernels.metadata import AttentionMetadata

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    FLASH_ATTN_AVAILABLE = True
except ImportError:  # also raised for a flash_attn built against another torch
    flash_attn_varlen_func = flash_attn_with_kvcache = None
    FLASH_ATTN_AVAILABLE = False

FLASH_BLOCK_MULTIPLE = 256


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Same contract as triton_attention_forward: store k/v at meta.slot_mapping, return [T, H, D]."""
    if not FLASH_ATTN_AVAILABLE:
        raise RuntimeError("flash_attn is not importable; use triton_attention_forward instead")
    block_size = k_cache.shape[1]
    if block_size % FLASH_BLOCK_MULTIPLE:
        raise ValueError(f"block_size ({block_size}) must be a multiple of {FLASH_BLOCK_MULTIPLE} for flash-attn")
    from flame_llm.kernels.triton_attention import store_kv  # graph-safe store (no boolean indexing)

    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.is_decode:
        num_seqs = meta.seq_lens.shape[0]
        out = torch.empty_like(q)
        out[:num_seqs] = flash_attn_with_kvcache(
            q[:num_seqs].unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
            block_table=meta.block_tables, softmax_scale=scale, causal=True).squeeze(1)
        return out
    if meta.fresh_only:
        return flash_attn_varlen_func(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q,
                                      meta.max_seqlen_q, softmax_scale=scale, causal=True)
    cu_k = meta.cu_seqlens_k
    if cu_k is None:
        cu_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
    return flash_attn_varlen_func(q, k_cache, v_cache, meta.cu_seqlens_q, cu_k, meta.max_seqlen_q,
                                  meta.max_seqlen_k, softmax_scale=scale, causal=True,
                                  block_table=meta.block_tables)
