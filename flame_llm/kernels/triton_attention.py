"""Paged attention on the GPU with our Triton kernels (see triton_kernels.py for the kernel design).

`triton_attention_forward` stores this step's K/V, then attends every query segment over its cached
keys. Decode steps (is_decode) launch without host syncs or value-dependent shapes, so they can be
captured in a CUDA graph."""
from __future__ import annotations

import functools
import logging
import math
from typing import NamedTuple

import torch
import triton

from flame_llm.kernels.fp8 import FP8_DTYPE, FP8_MAX
from flame_llm.kernels.metadata import AttentionMetadata
from flame_llm.kernels.triton_kernels import combine_splits_kernel, paged_attention_kernel, store_kv_kernel

logger = logging.getLogger(__name__)


class TileConfig(NamedTuple):
    block_m: int  # query rows per program: tokens x (query heads per kv head, padded to a power of 2)
    block_n: int  # keys per K/V tile
    num_warps: int
    num_stages: int


PREFILL_CONFIG = TileConfig(128, 64, 4, 3)  # best of the H200 sweep (bench/KERNELS.md)
DECODE_CONFIG = TileConfig(16, 64, 4, 3)  # block_m is raised to the padded GQA group when larger
SMALL_Q_ROWS = 64  # segments with at most this many (token, head) rows use the decode-style config
MIN_SPLIT_KEYS = 256  # split-KV never gives a split fewer keys than this (by max_seqlen_k)
MAX_SPLITS = 64


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # CPU (interpreter): behave like an H200 so the split-KV path is exercised
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into the cache rows slot_mapping [T]; slot -1 (padding) is skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), "cache blocks must be dense"
    assert k_cache.stride() == v_cache.stride() and slot_mapping.shape[0] >= num_tokens
    if num_tokens == 0:
        return
    store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        FP8_MAX=FP8_MAX if k_cache.dtype == FP8_DTYPE else 0.0)


def pick_config(meta: AttentionMetadata, group: int) -> TileConfig:
    group_pad = triton.next_power_of_2(group)
    if meta.is_decode or meta.max_seqlen_q * group_pad <= SMALL_Q_ROWS:
        rows = 1 if meta.is_decode else meta.max_seqlen_q
        block_m = max(DECODE_CONFIG.block_m, triton.next_power_of_2(rows * group_pad))
        return DECODE_CONFIG._replace(block_m=block_m)
    return PREFILL_CONFIG._replace(block_m=max(PREFILL_CONFIG.block_m, group_pad))


def pick_num_splits(num_programs: int, max_seqlen_k: int, num_sms: int) -> int:
    """Split the keys when the other grid dimensions leave SMs idle (small-batch decode / verify)."""
    if num_programs >= num_sms:
        return 1
    want = triton.cdiv(2 * num_sms, num_programs)
    n = max(1, min(want, max_seqlen_k // MIN_SPLIT_KEYS, MAX_SPLITS))
    return 1 << (n.bit_length() - 1)  # a power of two: NUM_SPLITS is a constexpr, so a closed set of compiles


# buckets 1-4 (8-32 programs of 8 kv heads) get this many splits or more from pick_num_splits; there more (N = 4's
# 64 / 32 / 16) measured 0-2 us a layer slower on the H100 (bench.engine.decode_splits, RESULTS session 20)
SMALL_BATCH_SPLITS = 8
# RunnerConfig.decode_split_waves, set by ModelRunner for its process (set_decode_split_waves); 0: pick_num_splits
_DECODE_SPLIT_WAVES = 0


def set_decode_split_waves(n: int) -> None:
    global _DECODE_SPLIT_WAVES
    _DECODE_SPLIT_WAVES = n


def decode_num_splits(num_programs: int, max_seqlen_k: int, num_sms: int) -> int:
    """A decode step's split count. decode_split_waves N > 0: no split once the programs fill half of N x the SMs,
    else split until they reach N x the SMs (a decode graph's grid is its bucket's, whose rows may be half padding,
    and one 8K-key program per (row, kv head) leaves SMs idle at the end of a wave: on the H200, N = 4 was the best
    or near-best split at every batch of 8-64 rows, bench.engine.decode_splits), except where the rule before already
    gives SMALL_BATCH_SPLITS or more (buckets 1-4: N = 4's doubling measured slower, H100 session 20); 0:
    pick_num_splits, which stops splitting once the programs reach the SMs."""
    before = pick_num_splits(num_programs, max_seqlen_k, num_sms)
    n_waves = _DECODE_SPLIT_WAVES
    if not n_waves or before >= SMALL_BATCH_SPLITS:
        return before
    if 2 * num_programs >= n_waves * num_sms:
        return 1
    n = max(1, min(triton.cdiv(n_waves * num_sms, num_programs), max_seqlen_k // MIN_SPLIT_KEYS, MAX_SPLITS))
    return 1 << (n.bit_length() - 1)


def split_choices() -> list[int]:
    """Every num_splits pick_num_splits can return (powers of two up to MAX_SPLITS)."""
    return [1 << i for i in range(MAX_SPLITS.bit_length()) if 1 << i <= MAX_SPLITS]


def reachable_configs(group: int, decode_only: bool = False) -> list[TileConfig]:
    """Every tile config pick_config can return for a GQA group (decode_only: decode steps alone)."""
    group_pad = triton.next_power_of_2(group)
    metas = [AttentionMetadata(None, None, None, None, 1, 1, is_decode=True)]
    if not decode_only:
        metas += [AttentionMetadata(None, None, None, None, q, q) for q in range(1, SMALL_Q_ROWS // group_pad + 2)]
    return sorted({pick_config(m, group) for m in metas})


@torch.inference_mode()
def warmup_all_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float,
                        decode_only: bool = False) -> int:
    """Compile every paged-attention and split-combine variant serving can reach (each reachable tile config
    x each split count) for this cache's dtype and shapes, so none compiles just in time under load.
    decode_only: the configs of decode steps alone (the fa4 backend sends only those rows here).
    Returns how many launches it made; each variant compiles once (or loads from Triton's disk cache)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    dev = k_cache.device
    group = num_heads // num_kv_heads
    # queries are in the model dtype: an e4m3 cache (kv_cache_dtype fp8) serves bf16 models
    q_dtype = torch.bfloat16 if k_cache.dtype == FP8_DTYPE else k_cache.dtype
    n = 0
    for cfg in reachable_configs(group, decode_only):
        q_len = max(1, cfg.block_m // triton.next_power_of_2(group))  # tokens of one query tile
        if q_dtype == torch.float32:  # as paged_attention_triton adjusts a picked config
            cfg = cfg._replace(block_n=min(cfg.block_n, 32), num_stages=1)
        q = torch.zeros(q_len, num_heads, head_dim, dtype=q_dtype, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        # one block-table column per block the q_len keys span (every one block 0): the kernel reads the
        # table for each key below seq_len, so a one-column table would be read past its end
        table = torch.zeros(1, triton.cdiv(q_len, block_size), **i32)
        meta = AttentionMetadata(torch.tensor([0, q_len], **i32), torch.tensor([q_len], **i32),
                                 table, torch.empty(0, dtype=torch.int64, device=dev), q_len, q_len)
        for splits in split_choices():
            paged_attention_triton(q, k_cache, v_cache, meta, scale, config=cfg, num_splits=splits)
            n += 1
    return n


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, config: TileConfig | None = None,
                           num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T, H, D] over the paged cache (no store). Rows past cu_seqlens_q[-1] are garbage."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size ({block_size}) must be a power of two")
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(0) == block_size * k_cache.stride(1), "cache blocks must be dense"
    assert meta.block_tables.stride(1) == 1
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    cfg = config or pick_config(meta, group)
    if config is None and q.dtype == torch.float32:  # fp32 tiles (tests) need 2x the shared memory
        cfg = cfg._replace(block_n=min(cfg.block_n, 32), num_stages=1)
    assert cfg.block_m % group_pad == 0 and cfg.block_m >= 16, f"block_m {cfg.block_m} vs group {group}"
    if out is None:
        out = torch.empty_like(q)
    num_seqs = meta.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    q_tiles = 1 if meta.is_decode else triton.cdiv(meta.max_seqlen_q, cfg.block_m // group_pad)
    if num_splits is None:
        num_splits = (decode_num_splits if meta.is_decode else pick_num_splits)(
            q_tiles * num_seqs * num_kv_heads, meta.max_seqlen_k, _sm_count(q.device))
    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the kernel
    paged_attention_kernel[(q_tiles, num_seqs, num_kv_heads * num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
        scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0), num_tokens * num_heads,
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays exact (tests)
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_splits > 1:
        combine_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_tokens * num_heads,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4)
    return out


def mixed_launch(max_tokens: int, group: int) -> tuple[TileConfig, int]:
    """The (tile config, split count) of a CUDA graph that holds steps of up to max_tokens query tokens over
    any segments (engine/mixed_graphs.py): the config pick_config gives a max_tokens-long segment, and splits
    that keep a few long decode rows from leaving SMs idle in small graphs (the grid cannot follow the step's
    real shape), fewer in larger graphs whose split partials would cost more than they save."""
    cfg = pick_config(AttentionMetadata(None, None, None, None, max_tokens, max_tokens), group)
    n = min(8, max(1, 1024 // max_tokens))
    return cfg, 1 << (n.bit_length() - 1)


def fixed_launch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """store_kv, then our kernel with meta.fixed_launch's config and splits: no host sync, no value-dependent
    launch, so a step of any shape within the graph's bucket replays the same grid."""
    cfg, splits = meta.fixed_launch
    if q.dtype == torch.float32:  # as paged_attention_triton adjusts a picked config (tests)
        cfg = cfg._replace(block_n=min(cfg.block_n, 32), num_stages=1)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return paged_attention_triton(q, k_cache, v_cache, meta, scale, config=cfg, num_splits=splits)


def triton_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store k/v [T, Hkv, D] at meta.slot_mapping, then return the attention output [T, H, D] of q."""
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return paged_attention_triton(q, k_cache, v_cache, meta, scale)
