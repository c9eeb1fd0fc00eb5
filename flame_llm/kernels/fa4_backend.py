"""Prefill attention through flash-attn-4 (FlashAttention for Hopper and Blackwell, written in the CuTe
DSL, `pip install flash-attn-4`) reading the paged cache directly; decode-only steps stay on our Triton
kernel, which is faster there (4.44 vs 4.07 TB/s at 64 x 8K on the H200) and is captured in CUDA graphs.

Every step with prefill tokens (fresh prompts, chunks, prefix hits, mixed steps with decodes) is one
`flash_attn_varlen_func` call: q segments by cu_seqlens_q, keys by seqused_k through the block table,
causal aligned to each segment's end. FA4 compiles a kernel variant the first time it meets a shape
class (split-KV or not, one query tile per sequence or more, ...), about 3 s each; `warmup` runs every
class the engine's limits allow at startup, and `jit_compiles()` counts the variants compiled since, so
a compile inside a measured burst shows in the engine's stats."""
from __future__ import annotations

import functools
import logging
import os

import torch

from flame_llm.kernels.metadata import AttentionMetadata
from flame_llm.kernels.triton_attention import paged_attention_triton, store_kv, warmup_all_variants

logger = logging.getLogger(__name__)
MIN_CAPABILITY = (9, 0)  # Hopper and newer: the kernels FA4 was measured with on this project


@functools.cache
def _varlen_fn():
    """flash_attn.cute.flash_attn_varlen_func, or the exception importing it raised."""
    # compiled kernels also go to FA4's disk cache, so a second engine process on the machine loads them
    # instead of compiling again (~3 s each); read at import, so set before it (a user's setting wins)
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    try:
        from flash_attn.cute import flash_attn_varlen_func
        return flash_attn_varlen_func
    except Exception as e:  # ImportError, or the CUTLASS DSL failing to load its libraries
        return e


def fa4_unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FA4 cannot serve this engine (None when it can)."""
    if device.type != "cuda":
        return f"device is {device.type}, not CUDA"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"compute capability {cap[0]}.{cap[1]} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (FA4 takes bfloat16 or float16)"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim} (FA4 takes multiples of 8 up to 256)"
    fn = _varlen_fn()
    if isinstance(fn, Exception):
        return f"flash_attn.cute does not import: {type(fn).__name__}: {fn}"
    return None


@functools.cache
def _compile_cache():
    """FA4's in-memory kernel variants (compiled here, or loaded from its disk cache): a dict of its keys."""
    from flash_attn.cute.interface import _flash_attn_fwd

    cache = _flash_attn_fwd.compile_cache
    return getattr(cache, "cache", cache)  # a JITCache wraps its dict


def _compile_keys() -> list:
    return list(_compile_cache())


def _compile_cache_size() -> int:  # checked after every eager step: no list of the keys
    return len(_compile_cache())


_compiles_at_warmup: int | None = None


def jit_compiles() -> int:
    """FA4 kernel variants first used since the last warmup (each a JIT compile, or a load from FA4's disk
    cache); 0 before any warmup."""
    return 0 if _compiles_at_warmup is None else _compile_cache_size() - _compiles_at_warmup


def new_variants() -> list:
    """The compile keys of the variants jit_compiles() counts (FA4's own tuples), for the log."""
    return [] if _compiles_at_warmup is None else _compile_keys()[_compiles_at_warmup:]


def fa4_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T, H, D] (segments by meta.cu_seqlens_q) over the paged cache (no store), into `out`
    when given (FA4's forward takes an output buffer; its public wrapper, an autograd Function, does not)."""
    kwargs = dict(cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                  seqused_k=meta.seq_lens, page_table=meta.block_tables, softmax_scale=scale, causal=True)
    return _fa4_call(q, k_cache, v_cache, out, kwargs)


def _fa4_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None, kwargs: dict
              ) -> torch.Tensor:
    """FA4's inference forward when this version has it (into `out`), else its public varlen function."""
    fwd = _forward_fn()
    if fwd is not None:
        return fwd(q, k, v, out=out, **kwargs)[0]
    res = _varlen_fn()(q, k, v, **kwargs)
    res = res[0] if isinstance(res, tuple) else res
    if out is not None:
        out.copy_(res)
        return out
    return res


@functools.cache
def _forward_fn():
    """FA4's inference forward (skips the autograd wrapper's host time, writes into `out`), if this FA4
    version has it under the name and signature we use."""
    try:
        import inspect

        from flash_attn.cute.interface import _flash_attn_fwd
        params = inspect.signature(_flash_attn_fwd).parameters
        need = ("q", "k", "v", "cu_seqlens_q", "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table",
                "softmax_scale", "causal", "out")
        return _flash_attn_fwd if all(n in params for n in need) else None
    except Exception:
        return None


def fa4_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Same contract as triton_attention_forward: store k/v at meta.slot_mapping, return [T, H, D].

    A mixed step whose leading segments are single tokens (meta.decode_split) sends those rows to our
    Triton decode kernel and the rest to FA4, each writing its rows of one output."""
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.is_decode:
        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    if meta.decode_split is None:
        return fa4_paged_attention(q, k_cache, v_cache, meta, scale)
    d, decode, rest = meta.decode_split
    out = torch.empty_like(q)
    paged_attention_triton(q[:d], k_cache, v_cache, decode, scale, out=out[:d])
    fa4_paged_attention(q[d:], k_cache, v_cache, rest, scale, out=out[d:])
    return out


def warmup_shapes(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                  block_size: int) -> list[tuple[list[int], list[int]]]:
    """(query lengths, key lengths) of steps covering the shape classes FA4 specializes on within the
    engine's limits: one or many sequences, short or long queries, none or many cached keys."""
    long_k = max_model_len - 1
    cases = []
    for b in sorted({1, 2, 4, 8, 16, 32, max_num_seqs}):
        if b > max_num_seqs:
            continue
        for q_len in (1, 8, 16, 32, 64, 128, 512, 2048, max_num_batched_tokens):
            q_tot = b * q_len
            if q_tot > max_num_batched_tokens or q_len >= max_model_len:
                continue
            for cached in sorted({0, block_size, 4 * block_size, long_k - q_len}):
                if 0 <= cached and cached + q_len <= max_model_len:
                    cases.append(([q_len] * b, [cached + q_len] * b))
        # a mixed step: decodes beside one prefill chunk
        if b > 1:
            chunk = min(max_num_batched_tokens - (b - 1), max_model_len - 1)
            cases.append(([1] * (b - 1) + [chunk], [long_k] * (b - 1) + [chunk]))
    return cases


def _warmup_steps(k_cache: torch.Tensor, num_heads: int, max_num_seqs: int, max_num_batched_tokens: int,
                  max_model_len: int):
    """(q, meta) of each warmup_shapes step whose block table fits the cache."""
    num_blocks, block_size, _, head_dim = k_cache.shape
    dev = k_cache.device
    for q_lens, k_lens in warmup_shapes(max_num_seqs, max_num_batched_tokens, max_model_len, block_size):
        width = -(-max(k_lens) // block_size)
        if width > num_blocks:
            continue
        q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=k_cache.dtype, device=dev)
        cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        tables = torch.arange(width, dtype=torch.int32, device=dev).repeat(len(q_lens), 1)
        meta = AttentionMetadata(cu_q, torch.tensor(k_lens, dtype=torch.int32, device=dev), tables,
                                 torch.empty(0, dtype=torch.int64, device=dev), max(q_lens), max(k_lens))
        yield q, meta


def _finish_warmup(dev: torch.device, before: int) -> int:
    global _compiles_at_warmup
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    _compiles_at_warmup = _compile_cache_size()
    return _compiles_at_warmup - before


@torch.inference_mode()
def warmup(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float, max_num_seqs: int,
           max_num_batched_tokens: int, max_model_len: int) -> int:
    """Compile every FA4 variant the engine's limits can reach (reads the cache, writes nothing to it); returns
    how many were compiled. jit_compiles() counts from here."""
    before = _compile_cache_size()
    for q, meta in _warmup_steps(k_cache, num_heads, max_num_seqs, max_num_batched_tokens, max_model_len):
        fa4_paged_attention(q, k_cache, v_cache, meta, scale)
    # a mixed step's decode rows go to our Triton decode kernel with a split count that follows the step:
    # compile each split count's variant now, not under load
    warmup_all_variants(k_cache, v_cache, num_heads, scale, decode_only=True)
    return _finish_warmup(k_cache.device, before)
