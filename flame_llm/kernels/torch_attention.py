"""Reference attention over the paged KV cache in plain torch: the CPU path and the GPU reference.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. Every sequence is one query
segment (prefill chunk, prefix hit, decode or speculative verify alike): its q_len new tokens sit at
the end of its seq_len keys, causal by position."""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] to their slots; slot -1 (padding) is skipped."""
    nh, hd = k_cache.shape[-2:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k, v = k[keep], v[keep]
    if k_cache.dtype == torch.float8_e4m3fn:  # kv_cache_dtype fp8, scale 1.0: saturate (e4m3 has no inf)
        fmax = torch.finfo(k_cache.dtype).max
        k, v = (_raw(x.clamp(-fmax, fmax).to(k_cache.dtype)) for x in (k, v))
    k_cache, v_cache = _raw(k_cache), _raw(v_cache)
    k_cache.view(-1, nh, hd)[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, nh, hd)[slots] = v.to(v_cache.dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor as its bytes (uint8; indexing kernels take every device's uint8), any other as it is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached rows of one sequence as [seq_len, num_kv_heads, head_dim]."""
    bs = cache.shape[1]
    nblocks = (seq_len + bs - 1) // bs
    return _raw(cache)[block_table[:nblocks].long()].flatten(0, 1)[:seq_len].view(cache.dtype)


# padded decode batches gather at most this many bytes of keys at once (B x longest context x heads x
# head_dim); past it the batch is split, so the transient K/V copy stays bounded
DECODE_GATHER_BYTES = 64 << 20
_local = threading.local()  # per thread: two engines stepping on two threads never share a buffer


def _gather_buffer(key: tuple, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reused flat buffer: fresh multi-MB allocations every layer cost more than the gather itself."""
    scratch = _local.__dict__.setdefault("scratch", {})
    buf = scratch.get(key)
    if buf is None or buf.numel() < numel:
        buf = scratch[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence (q [B, H, D]) over its seq_len cached keys: sequences sorted by length,
    grouped, each group padded to its longest context and masked, one SDPA call per group."""
    out = torch.empty_like(q)
    _, bs, num_kv_heads, head_dim = k_cache.shape
    max_rows = max(1, DECODE_GATHER_BYTES // (num_kv_heads * head_dim * k_cache.element_size()))
    all_lens = seq_lens.tolist()
    order = sorted(range(len(all_lens)), key=all_lens.__getitem__)  # similar lengths pad little
    lens = [all_lens[i] for i in order]
    start = 0
    while start < len(lens):
        end = start + 1
        while end < len(lens) and (end - start + 1) * lens[end] <= max_rows:
            end += 1
        longest = lens[end - 1]
        rows = torch.tensor(order[start:end], device=q.device)
        nb = (longest + bs - 1) // bs
        table = block_tables[rows, :nb].reshape(-1).long()
        shape = (end - start, nb * bs, num_kv_heads, head_dim)
        kv = []
        for name, cache in (("k", k_cache), ("v", v_cache)):
            # an inference-mode tensor cannot be written outside inference mode: one buffer per mode
            key = (name, cache.dtype, cache.device, torch.is_inference_mode_enabled())
            buf = _gather_buffer(key, table.numel() * bs * num_kv_heads * head_dim, _raw(cache))
            x = torch.index_select(_raw(cache), 0, table, out=buf.view(-1, bs, num_kv_heads, head_dim)).view(shape)
            kv.append(x[:, :longest].view(cache.dtype))
        mask = torch.arange(longest, device=q.device)[None, :] < seq_lens[rows, None]
        # rows past a sequence's length are whatever the pool holds (NaN included): a masked score
        # still multiplies its value row, so they must be finite
        kv = [x.to(q.dtype) for x in kv]  # the same tensors, unless the cache is e4m3 (kv_cache_dtype fp8)
        for x in kv:
            x.masked_fill_(~mask[:, :, None, None], 0)
        k, v = (x.transpose(1, 2) for x in kv)  # [b, Hkv, L, D]
        o = F.scaled_dot_product_attention(q[rows, :, None], k, v, attn_mask=mask[:, None, None, :],
                                           scale=scale, enable_gqa=True)
        out[rows] = o[:, :, 0]
        start = end
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] -> out of the same shape. Rows past cu_seqlens_q[-1] are 0."""
    out = torch.zeros_like(q)
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len).to(q.dtype)
        v = gather_kv(v_cache, block_tables[i], seq_len).to(q.dtype)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[start:end].transpose(0, 1)  # [H, q_len, D]
        # query j sits at absolute position seq_len - q_len + j and sees keys 0..that position
        qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Causal attention of each segment over its own fresh k/v (no cache involved). On CUDA the math
    fallback is excluded: it would materialize [heads, L, L] scores (128 GiB at 32K tokens)."""
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return _dense_causal(q, k, v, cu_seqlens_q, scale)
    return _dense_causal(q, k, v, cu_seqlens_q, scale)


def _dense_causal(q, k, v, cu_seqlens_q, scale):
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    cu = cu_seqlens_q.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        if end == start:
            continue
        # fused SDPA kernels need 4-D [batch, heads, len, head_dim] inputs
        qi = q[start:end].transpose(0, 1).unsqueeze(0)
        ki = k[start:end].repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        vi = v[start:end].repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        out[start:end] = o[0].transpose(0, 1)
    return out


def torch_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """The torch backend: store the step's K/V, then attend. Fresh-only steps attend to k/v directly."""
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.fresh_only:
        return dense_causal_attention(q, k, v, meta.cu_seqlens_q, scale)
    if meta.is_decode and q.shape[0] == meta.seq_lens.shape[0]:
        return paged_decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale)
    return paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale)
