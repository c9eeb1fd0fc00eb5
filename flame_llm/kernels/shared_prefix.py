"""Decode attention that reads a shared prefix once for all the sequences holding it
(RunnerConfig.shared_prefix_decode).

Under prefix caching, sequences that start with the same cached blocks (the questions of one document) have the
same block ids at the front of their block tables. A decode step's usual kernel reads those keys once per
sequence; here the step's rows are cut into segments (plan_segments, on the host):
  - a group's shared segment: up to MAX_MEMBERS sequences' queries x the keys of their common full blocks, so each
    K/V tile is loaded once and used by every member (each member's GQA heads are rows of one query tile);
  - each sequence's own segment: its keys after the shared ones (all of them for a sequence in no group).
Each segment writes a partial (output, log-sum-exp) per query row and head into slot 0 (shared) or 1 (own), times
num_splits key splits; triton_kernels.combine_splits_kernel merges a row's 2 x num_splits partials. An own segment
of a row with no shared part writes that row's slot-0 partials as empty (weight 0), so no buffer is cleared.

A segment is a row of SEG_WIDTH int32: block-table row, first key, end key, kind (SHARED, OWN, OWN_ALONE), then
MAX_MEMBERS query rows (-1: none; a segment whose first member is -1 is padding and does nothing)."""
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from flame_llm.kernels.metadata import SharedPrefix
from flame_llm.kernels.triton_kernels import _attend, _jit, combine_splits_kernel

MAX_MEMBERS = 8  # sequences per shared segment; a larger group is cut into near-equal parts
MIN_SHARED_TOKENS = 256  # a common prefix shorter than this is read per sequence as before
MAX_SHARED_SPLITS = 8  # key splits of a launch (its partials: 2 x splits x rows x heads x head_dim fp32)
SHARED, OWN, OWN_ALONE = 0, 1, 2
SEG_WIDTH = 4 + MAX_MEMBERS


def plan_segments(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int,
                  capacity: int | None = None) -> tuple[np.ndarray, int, int]:
    """(int32 [S, SEG_WIDTH] segments, shared segments, longest segment's keys) of decode rows with these block
    tables [B, W] and key counts [B]. capacity: pad to that many segments (a CUDA graph's fixed grid; at least
    B + B // 2, since a group has two or more members)."""
    num = len(seq_lens)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    full = (seq_lens - 1) // block_size  # blocks wholly before each row's own query position
    own_lo = np.zeros(num, dtype=np.int64)
    shared: list[np.ndarray] = []
    min_blocks = max(1, -(-MIN_SHARED_TOKENS // block_size))
    cand = np.flatnonzero(full >= min_blocks)
    if len(cand) > 1:
        cand = cand[np.argsort(block_tables[cand, 0], kind="stable")]
        firsts = block_tables[cand, 0]
        cuts = np.flatnonzero(np.diff(firsts)) + 1
        for rows in np.split(cand, cuts):
            if len(rows) < 2:
                continue
            for chunk in np.array_split(rows, -(-len(rows) // MAX_MEMBERS)):
                if len(chunk) < 2:
                    continue
                width = int(full[chunk].min())
                t = block_tables[chunk, :width]
                same = (t == t[0]).all(0)
                n = width if same.all() else int(np.argmin(same))
                if n < min_blocks:
                    continue
                seg = np.full(SEG_WIDTH, -1, dtype=np.int64)
                seg[:4] = chunk[0], 0, n * block_size, SHARED
                seg[4: 4 + len(chunk)] = chunk
                shared.append(seg)
                own_lo[chunk] = n * block_size
    own = np.full((num, SEG_WIDTH), -1, dtype=np.int64)
    own[:, 0], own[:, 1], own[:, 2], own[:, 4] = np.arange(num), own_lo, seq_lens, np.arange(num)
    own[:, 3] = np.where(own_lo > 0, OWN, OWN_ALONE)
    segs = np.concatenate([np.stack(shared), own]) if shared else own
    longest = int((segs[:, 2] - segs[:, 1]).max()) if num else 0
    if capacity is not None:
        assert capacity >= len(segs), f"{len(segs)} segments exceed the capacity {capacity}"
        pad = np.zeros((capacity - len(segs), SEG_WIDTH), dtype=np.int64)
        pad[:, 4:] = -1
        segs = np.concatenate([segs, pad])
    return segs.astype(np.int32), len(shared), longest


def graph_capacity(batch: int) -> int:
    """Segments a CUDA graph of `batch` decode rows holds: every own segment plus the most groups there can be."""
    return batch + batch // 2


def pick_shared_splits(meta: SharedPrefix, num_kv_heads: int, num_sms: int) -> int:
    """Split the keys while the shared segments alone (the long ones) leave SMs idle; a power of two."""
    if meta.num_splits is not None:
        return meta.num_splits
    busy = max(1, meta.num_shared) * num_kv_heads
    if busy >= num_sms:
        return 1
    n = max(1, min(triton.cdiv(2 * num_sms, busy), meta.longest // 256, MAX_SHARED_SPLITS))
    return 1 << (n.bit_length() - 1)


@_jit
def shared_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, seg_ptr, bt_ptr, qk_scale,
        stride_qt, stride_qh, stride_crow, stride_ch, stride_bt, stride_psplit,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        MAX_MEMBERS: tl.constexpr, SEG_WIDTH: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    kv_head = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    base = seg_ptr + seg * SEG_WIDTH
    if tl.load(base + 4) < 0:  # padding (a CUDA graph's spare segment)
        return
    bt_row = bt_ptr + tl.load(base).to(tl.int64) * stride_bt
    seg_lo = tl.load(base + 1)
    seg_hi = tl.load(base + 2)
    kind = tl.load(base + 3)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    slot_m = offs_m // GROUP_PAD
    member = tl.load(base + 4 + slot_m, mask=slot_m < MAX_MEMBERS, other=-1)
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (member >= 0) & (offs_m % GROUP_PAD < GROUP)
    tok = tl.where(member >= 0, member, 0)
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=q_mask,
                other=0.0)

    split_len = tl.cdiv(tl.cdiv(seg_hi - seg_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    k_lo = seg_lo + split * split_len
    k_hi = tl.minimum(seg_hi, k_lo + split_len)
    full_hi = tl.maximum(k_lo + ((k_hi - k_lo) // BLOCK_N) * BLOCK_N, k_lo)
    qpos = tl.full([BLOCK_M], 0, dtype=tl.int32) + (seg_hi - 1)  # every key of the segment is visible
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    head_off = kv_head * stride_ch
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off, k_lo, full_hi, qpos,
                            seg_hi, qk_scale, stride_crow, offs_n, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE,
                            False, DOT_PRECISION)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off, full_hi, k_hi, qpos,
                            seg_hi, qk_scale, stride_crow, offs_n, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE,
                            True, DOT_PRECISION)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
    slot = tl.where(kind == 0, 0, 1)  # SHARED: slot 0; OWN, OWN_ALONE: slot 1
    idx = (slot * NUM_SPLITS + split) * stride_psplit + tok * NUM_HEADS + head
    tl.store(part_lse_ptr + idx, lse, mask=row_ok)
    tl.store(part_out_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=q_mask)
    if kind == 2:  # OWN_ALONE: no shared segment writes this row's slot 0, so mark it empty
        idx0 = split * stride_psplit + tok * NUM_HEADS + head
        tl.store(part_lse_ptr + idx0, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=row_ok)
        tl.store(part_out_ptr + idx0[:, None] * HEAD_DIM + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=q_mask)


def shared_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            shared: SharedPrefix, scale: float, block_n: int, num_warps: int, num_stages: int,
                            num_sms: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of q [B, H, D] (one query per row) over the paged cache, by shared.segments."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    splits = pick_shared_splits(shared, num_kv_heads, num_sms)
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_out = torch.empty(2 * splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(2 * splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
    shared_decode_kernel[(shared.segments.shape[0], num_kv_heads * splits)](
        q, k_cache, v_cache, part_out, part_lse, shared.segments, block_tables, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_tokens * num_heads, NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_M=max(16, MAX_MEMBERS * group_pad), BLOCK_N=block_n, BLOCK_SIZE=block_size,
        MAX_MEMBERS=MAX_MEMBERS, SEG_WIDTH=SEG_WIDTH, NUM_SPLITS=splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages)
    combine_splits_kernel[(num_tokens, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), num_tokens * num_heads, NUM_HEADS=num_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=2 * splits, SPLITS_PAD=triton.next_power_of_2(2 * splits),
        num_warps=4)
    return out

