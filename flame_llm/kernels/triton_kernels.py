"""Triton kernels for the paged KV cache: KV store, paged attention (prefill, chunks, prefix hits,
decode and verify in one kernel) and the split-KV combine.

Attention program = (query tile, sequence, kv head [x split]). A query tile packs BLOCK_M rows as
(token, head-in-group) pairs, so every query head of a kv head shares each K/V tile it loads. K/V
tiles are BLOCK_N consecutive keys read straight from the paged cache: when BLOCK_N <= block_size a
tile lies inside one block (one block-table load, BLOCK_N contiguous rows), otherwise it is
BLOCK_N // block_size whole blocks. Keys below the tile's first query position need no mask; the
few tiles on the diagonal are masked; tiles past the last query position are never visited.
Scores are kept in the log2 domain (scale * log2(e) folded in) so the softmax uses exp2."""
from __future__ import annotations

import inspect

import triton
import triton.language as tl

# Arguments that change from step to step but buy nothing from Triton's value specialisation (== 1, % 16,
# 16-byte pointer alignment): the metadata pointers are slices of one staging buffer at any offset, and the
# block-table width and split stride follow the step's shape. Left specialised, each new combination is a
# JIT compile mid-serving (seconds); not specialised, one compile serves every step (issue 18 item 3).
STEP_VARYING = ("slot_ptr", "pos_ptr", "cu_q_ptr", "seq_lens_ptr", "bt_ptr", "stride_bt", "stride_psplit",
                "seg_ptr")


def _jit(fn):
    names = [n for n in inspect.signature(fn).parameters if n in STEP_VARYING]
    kwargs = {"do_not_specialize": names}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kwargs["do_not_specialize_on_alignment"] = names
    return triton.jit(**kwargs)(fn)


@_jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                    stride_kt, stride_kh, stride_vt, stride_vh, stride_cslot, stride_ch,
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr = 0.0):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padded row
        return
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    dst = slot * stride_cslot + offs_h * stride_ch + offs_d
    if FP8_MAX > 0:  # kv_cache_dtype fp8 (scale 1.0): saturate, e4m3 has no inf
        k = tl.minimum(tl.maximum(k.to(tl.float32), -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -FP8_MAX), FP8_MAX)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_rows(bt_ptr, start, offs_n, seq_len, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Cache row (block * block_size + offset, int64) of keys start .. start + BLOCK_N."""
    if BLOCK_N <= BLOCK_SIZE:
        block = tl.load(bt_ptr + start // BLOCK_SIZE).to(tl.int64)
        return block * BLOCK_SIZE + (start % BLOCK_SIZE) + offs_n
    else:
        keys = start + offs_n
        # keys past the sequence may index past its block-table row: read block 0 instead
        block = tl.load(bt_ptr + keys // BLOCK_SIZE, mask=keys < seq_len, other=0).to(tl.int64)
        return block * BLOCK_SIZE + keys % BLOCK_SIZE


@triton.jit
def _attend(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_ptr, head_off, lo, hi, qpos, seq_len,
            qk_scale, stride_crow, offs_n, offs_d,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over key tiles [lo, hi). MASKED: apply the causal and sequence-end masks."""
    for start in range(lo, hi, BLOCK_N):
        rows = _kv_rows(bt_ptr, start, offs_n, seq_len, BLOCK_N, BLOCK_SIZE)
        offs = rows[:, None] * stride_crow + head_off + offs_d[None, :]
        if MASKED:
            keys = start + offs_n
            # masked so that garbage (even NaN) past the sequence end never reaches P @ V
            kv_mask = (keys[:, None] < seq_len) & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_cache_ptr + offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            v = tl.load(v_cache_ptr + offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_cache_ptr + offs)
            v = tl.load(v_cache_ptr + offs)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an e4m3 cache (kv_cache_dtype fp8) is read in q's dtype; else no-ops
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            s = tl.where(keys[None, :] <= qpos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:  # a row may still have seen no key at all
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        alpha = tl.exp2(m_i - m_new_safe)
        p = tl.exp2(s - m_new_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@_jit
def paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        cu_q_ptr, seq_lens_ptr, bt_ptr, qk_scale,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_crow, stride_ch, stride_bt, stride_psplit,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD  # tokens per query tile
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: the longest rows start first
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # cached keys before this segment

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tile * BLOCK_Q + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    qpos = ctx_len + tok
    q_offs = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)

    # keys this program visits: [k_lo, k_hi); unmasked below diag_lo, masked from there on
    first_pos = tl.maximum(ctx_len + tile * BLOCK_Q, 0)
    k_end = tl.minimum(ctx_len + (tile + 1) * BLOCK_Q, seq_len)  # one past the last query position
    diag_lo = (first_pos // BLOCK_N) * BLOCK_N
    if NUM_SPLITS == 1:
        k_lo = seq_len * 0
        k_hi = k_end
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        k_lo = split * split_len
        k_hi = tl.minimum(k_end, k_lo + split_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off,
                            k_lo, tl.minimum(k_hi, diag_lo), qpos, seq_len, qk_scale, stride_crow,
                            offs_n, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, False, DOT_PRECISION)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off,
                            tl.maximum(k_lo, diag_lo), k_hi, qpos, seq_len, qk_scale, stride_crow,
                            offs_n, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # a row with no keys (seq_len 0) yields 0, not NaN
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        o_offs = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # partials are [NUM_SPLITS, T, NUM_HEADS, HEAD_DIM] fp32 and lse [NUM_SPLITS, T, NUM_HEADS]
        idx = split * stride_psplit + (q_start + tok) * NUM_HEADS + head
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + idx, lse, mask=row_ok)
        tl.store(part_out_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_mask)


@_jit
def combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, stride_psplit,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    idx = offs_s * stride_psplit + t * NUM_HEADS + h
    lse = tl.load(part_lse_ptr + idx, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
    denom = tl.sum(w, 0)
    o = tl.load(part_out_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
