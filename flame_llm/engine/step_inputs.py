"""Host-side inputs of one forward, built with numpy, and their upload through pinned staging buffers.

A step is a list of query segments: sequence i computes positions [start_i, start_i + n_i). Token ids
come from the sequence; a position at or past its known tokens is the token the previous, still
running step samples for it (asynchronous scheduling): its row is listed in `pending_rows` and filled
on the device from that step's sampled tensor. Slots come from the block table, one vectorized gather
for the whole step."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flame_llm.engine.sequence import Sequence
from flame_llm.kernels.metadata import AttentionMetadata

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


@dataclass(slots=True)
class StepInputs:
    input_ids: np.ndarray  # int64 [T]; pending rows hold 0 until filled on the device
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    cu_seqlens_q: np.ndarray  # int32 [B+1]
    seq_lens: np.ndarray  # int32 [B]: keys per sequence after this step
    block_tables: np.ndarray  # int32 [B, W], padded with 0
    logits_rows: np.ndarray  # int64 [S]: the last row of each sampling segment
    sample_idx: list[int]  # the S sequences that sample a token this step
    pending_rows: np.ndarray  # int64 [P]: rows whose token the previous step is sampling
    pending_seqs: list[int]  # the sequence of each pending row
    pending_src: np.ndarray  # int64 [P]: each pending row's row in the previous step's sampled tokens (runner)
    max_seqlen_q: int
    max_seqlen_k: int
    fresh_only: bool  # no segment has cached keys
    is_decode: bool  # every segment is one token


def build_step_inputs(seqs: list[Sequence], num_tokens: list[int], block_size: int,
                      starts: list[int] | None = None) -> StepInputs:
    """Inputs for seqs computing num_tokens positions each, from starts (default: num_computed_tokens).

    A segment that reaches its sequence's end (its known tokens plus a pending one) samples."""
    num = len(seqs)
    assert num > 0 and len(num_tokens) == num
    if starts is None:
        starts = [s.num_computed_tokens for s in seqs]
    flat: list[int] = []
    sample_idx: list[int] = []
    pending_rows: list[int] = []
    pending_seqs: list[int] = []
    table_lens = np.empty(num, dtype=np.int64)
    for i, (seq, start, n) in enumerate(zip(seqs, starts, num_tokens)):
        end = start + n
        known = seq.num_tokens
        assert n >= 1 and end <= known + 1, "at most the one token being sampled is unknown"
        flat += seq.token_ids[start:end]
        if end > known:
            pending_rows.append(len(flat))
            pending_seqs.append(i)
            flat.append(0)
        if end >= known:
            sample_idx.append(i)
        table_lens[i] = len(seq.block_table)
    lens = np.asarray(num_tokens, dtype=np.int64)
    start_arr = np.asarray(starts, dtype=np.int64)
    cu = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    total = int(cu[-1])
    seg = np.repeat(np.arange(num), lens)
    positions = np.arange(total, dtype=np.int64) + np.repeat(start_arr - cu[:-1], lens)
    width = int(table_lens.max())
    tables = np.zeros((num, width), dtype=np.int32)
    for i, seq in enumerate(seqs):
        tables[i, : table_lens[i]] = seq.block_table
    block_idx = positions // block_size
    assert (block_idx < table_lens[seg]).all(), "every computed position has a block"
    slots = tables[seg, block_idx].astype(np.int64) * block_size + positions % block_size
    seq_lens = start_arr + lens
    return StepInputs(np.asarray(flat, dtype=np.int64), positions, slots, cu.astype(np.int32),
                      seq_lens.astype(np.int32), tables, (cu[1:] - 1)[sample_idx], sample_idx,
                      np.asarray(pending_rows, dtype=np.int64), pending_seqs, np.empty(0, dtype=np.int64),
                      int(lens.max()),
                      int(seq_lens.max()), bool((start_arr == 0).all()), total == num)


@dataclass(slots=True)
class DeviceInputs:
    """A forward's device tensors; the row fields come from upload() (a step of the model runner)."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor | None = None
    pending_rows: torch.Tensor | None = None
    pending_src: torch.Tensor | None = None


class Staging:
    """Pinned host buffers for host-to-device copies that do not block the host (a pageable copy
    synchronizes the stream, which would stall asynchronous scheduling). A ring of them, each guarded
    by an event, so the host never rewrites one whose copy is still queued."""

    RING = 8

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._bufs: list[dict[str, torch.Tensor]] = [{} for _ in range(self.RING)]
        self._events: list[torch.cuda.Event | None] = [None] * self.RING
        self._next = 0

    def put(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Device copies of same-dtype groups of arrays: one copy per dtype."""
        if not self.pinned:
            return {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
        slot = self._next
        self._next = (slot + 1) % self.RING
        if self._events[slot] is not None:
            self._events[slot].synchronize()
        groups: dict[np.dtype, list[tuple[str, np.ndarray]]] = {}
        for k, a in arrays.items():
            groups.setdefault(a.dtype, []).append((k, a.reshape(-1)))
        out: dict[str, torch.Tensor] = {}
        for dtype, items in groups.items():
            total = sum(a.size for _, a in items)
            key = str(dtype)
            buf = self._bufs[slot].get(key)
            if buf is None or buf.numel() < total:
                buf = torch.empty(max(total, 4096), dtype=_TORCH_DTYPES[dtype], pin_memory=True)
                self._bufs[slot][key] = buf
            host = buf.numpy()
            off = 0
            for _, a in items:
                host[off: off + a.size] = a
                off += a.size
            dev = buf[:total].to(self.device, non_blocking=True)
            off = 0
            for k, a in items:
                out[k] = dev[off: off + a.size].view(arrays[k].shape)
                off += a.size
        event = torch.cuda.Event()
        event.record()
        self._events[slot] = event
        return out


def upload(staging: Staging, x: StepInputs, split_decodes: bool = False, prune: bool = False) -> DeviceInputs:
    """The step's tensors on the device. split_decodes: a mixed step that starts with single-token
    segments also gets metadata for those rows as a decode step and for the rest as their own varlen step.
    prune: meta.kept describes the sampled rows (logits_rows) as a decode step (prune_last_layer)."""
    arrays = {"ids": x.input_ids, "pos": x.positions, "slots": x.slot_mapping, "rows": x.logits_rows,
              "pending": x.pending_rows, "src": x.pending_src, "cu": x.cu_seqlens_q, "lens": x.seq_lens,
              "tables": x.block_tables}
    prune = prune and bool(x.sample_idx)
    if prune:  # each sampled row ends its segment: its query sees all seq_lens keys, as a decode query
        arrays.update(k_cu=np.arange(len(x.sample_idx) + 1, dtype=np.int32), k_lens=x.seq_lens[x.sample_idx],
                      k_tables=x.block_tables[x.sample_idx])
    d, lens = 0, None
    if split_decodes and not x.is_decode:
        lens = np.diff(x.cu_seqlens_q)
        d = int(np.argmin(lens == 1))  # leading one-token segments
    if d:
        arrays["cu_rest"] = (x.cu_seqlens_q[d:] - d).astype(np.int32)
    t = staging.put(arrays)
    meta = AttentionMetadata(t["cu"], t["lens"], t["tables"], t["slots"], x.max_seqlen_q, x.max_seqlen_k,
                             is_decode=x.is_decode, fresh_only=x.fresh_only)
    if d:
        rest_lens = x.seq_lens[d:]
        decode = AttentionMetadata(t["cu"][: d + 1], t["lens"][:d], t["tables"][:d], t["slots"][:d], 1,
                                   int(x.seq_lens[:d].max()), is_decode=True)
        rest = AttentionMetadata(t["cu_rest"], t["lens"][d:], t["tables"][d:], t["slots"][d:],
                                 int(lens[d:].max()), int(rest_lens.max()))
        meta.decode_split = (d, decode, rest)
    if prune:
        meta.kept = AttentionMetadata(t["k_cu"], t["k_lens"], t["k_tables"], t["slots"][:0], 1,
                                      int(x.seq_lens[x.sample_idx].max()), is_decode=True)
    return DeviceInputs(t["ids"], t["pos"], meta, t["rows"], t["pending"], t["src"])
