"""Prompt-prefix identity for routing, the work estimates the router balances, and the router's request
and completion records.

A prompt's routing identity is the chain of `flame_llm.prefix.hash_block` hashes over its first
`max_tokens` tokens in blocks of `block` tokens, the chain seeded with the model revision. Two
prompts sharing their first k full blocks share the first k entries of their chains.

The chain is the engine's own: hash_block chained over blocks of `hash_block` tokens (the engines' KV block
size, CacheConfig.block_size) from the revision's seed, as the BlockManager hashes its KV blocks with
enable_kv_events; a routing block of `block` tokens is `block // hash_block` engine blocks, and its key is
the chain's hash at its last engine block. So the router looks a prompt's keys up directly in the block
hashes the engines publish (flame_llm/protocol/kv_events.py), with no second index.

Prompts shorter than one block get a single key over all their tokens (there is no full block to
hash). So a short prompt and a longer prompt that starts with it do not share a key; short prompts
are cheap to prefill, so their placement matters little. A trailing partial block of a longer
prompt is not part of its identity.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from flame_llm.prefix import DEFAULT_BLOCK_SIZE, revision_seed
from flame_llm.prefix import hash_block as _hash

ROUTING_BLOCK = 256
ROUTING_MAX_TOKENS = 1024
# Context length at which one token's attention FLOPs equal its weight FLOPs. Llama-3.1-8B: about
# 16 GFLOP of weights per token against 4 * 4096 * 32 = 0.5 MFLOP per attended position.
ATTN_CROSSOVER_TOKENS = 32768.0
# Cost of one decoded token in prefill-token units: one H200 decodes batch 64 at ~21.6 ms/step
# (0.34 ms/token) and prefills ~38k tokens/s (0.026 ms/token), about 13x; rounded down.
DECODE_TOKEN_COST = 10.0


@lru_cache(maxsize=64)
def _seed(model_revision: str) -> int:
    return revision_seed(model_revision)


def prefix_chain(token_ids: Sequence[int] | np.ndarray, model_revision: str, block: int = ROUTING_BLOCK,
                 max_tokens: int = ROUTING_MAX_TOKENS, hash_block: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """Chained block hashes of the prompt's first max_tokens tokens (see the module docstring)."""
    if block < 1 or max_tokens < block:
        raise ValueError(f"block must be >= 1 and max_tokens >= block; got block={block}, "
                         f"max_tokens={max_tokens}")
    if hash_block < 1 or block % hash_block:
        raise ValueError(f"block must be a multiple of hash_block (the engines' KV block size); got block={block}, "
                         f"hash_block={hash_block}")
    n = min(len(token_ids), max_tokens)
    if n == 0:
        raise ValueError("token_ids must hold at least 1 token to have a routing key; got 0")
    head = np.asarray(token_ids[:n], dtype="<u4")
    h = _seed(model_revision)
    if n < block:
        return [_hash(head, h)]
    chain, k = [], block // hash_block
    for i in range(n // block * k):
        h = _hash(head[i * hash_block:(i + 1) * hash_block], h)
        if i % k == k - 1:
            chain.append(h)
    return chain


def estimate_prefill_work(num_tokens: int, cached_tokens: int = 0) -> float:
    """Prefill cost in token units: one unit per new token (weights) plus the causal attention of
    the new tokens over everything before them, sum of positions c..n-1, scaled so a token attending
    ATTN_CROSSOVER_TOKENS positions costs one more unit."""
    if num_tokens < 0 or not 0 <= cached_tokens <= num_tokens:
        raise ValueError(f"need 0 <= cached_tokens <= num_tokens; got num_tokens={num_tokens}, "
                         f"cached_tokens={cached_tokens}")
    new = num_tokens - cached_tokens
    attended = (num_tokens * num_tokens - cached_tokens * cached_tokens) / 2.0
    return new + attended / ATTN_CROSSOVER_TOKENS



class RouteItem(NamedTuple):
    """One request as the router sees it."""
    chain: list[int]  # prefix_chain(prompt, model_revision)
    est_prefill_work: float  # estimate_prefill_work(prompt tokens)
    est_decode_tokens: int  # the request's max_tokens


class Completion(NamedTuple):
    """One finished request fed back to the router: its routing-time estimates and what it cost."""
    shard: int
    est_prefill_work: float
    est_decode_tokens: int
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the shard's prefix cache (0 for a failed request)
