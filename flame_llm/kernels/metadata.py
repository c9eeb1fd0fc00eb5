"""Per-step attention metadata, set by the ModelRunner before the forward and read by every layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # int32 [B+1]: query segment starts; a segment's tokens end its keys
    seq_lens: torch.Tensor  # int32 [B]: keys per sequence after this step's tokens are stored
    block_tables: torch.Tensor  # int32 [B, max_blocks]; entries past a sequence's blocks are padding
    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token; -1 = padded row, not stored
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode: bool = False  # every segment has exactly one query (CUDA-graph path, cu_seqlens_q = arange)
    fresh_only: bool = False  # no segment has cached keys (seq_lens == query lengths)
    cu_seqlens_k: torch.Tensor | None = None  # int32 [B+1], cumulative seq_lens (flash-attn varlen)
    # a mixed step whose first segments are single tokens (decode-first order): (that many, metadata of those
    # rows as a decode step, metadata of the rest); backends that are better at decode use it
    decode_split: tuple[int, AttentionMetadata, AttentionMetadata] | None = None
    # a step captured in a CUDA graph whatever its backend: our Triton kernel with this (TileConfig, num_splits)
    # and a grid fixed by max_seqlen_q (the graph's token bucket) and the segment count (engine/mixed_graphs.py)
    fixed_launch: tuple | None = None
    # prune_last_layer: the sampled rows' queries of the last layer as a decode step over the same caches (one
    # query per sampling sequence, seq_lens/block_tables of those sequences, no slot_mapping: already stored)
    kept: AttentionMetadata | None = None


_CONTEXT: AttentionMetadata | None = None


def set_context(meta: AttentionMetadata | None) -> None:
    global _CONTEXT
    _CONTEXT = meta


def get_context() -> AttentionMetadata:
    assert _CONTEXT is not None, "attention metadata is set by the ModelRunner before each forward"
    return _CONTEXT
