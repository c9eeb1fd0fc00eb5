"""The one prefix-hash function: a chained xxh64 over blocks of token ids.

The engine's BlockManager hashes its KV blocks with it; the router, client and bench hash prompt
prefixes with it (seeded with the model revision)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

# CacheConfig.block_size's default: the engines' KV block, the unit the routing key's chain hashes (routing_key.py)
DEFAULT_BLOCK_SIZE = 128


def hash_block(token_ids: Sequence[int] | np.ndarray, prev: int = -1) -> int:
    """Hash of one block of token ids chained onto the previous block's hash (-1: first block)."""
    h = xxhash.xxh64()
    if prev != -1:
        h.update(prev.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    return h.intdigest()


def revision_seed(model_revision: str) -> int:
    """The chain's starting value for a model revision, so two revisions never share a prefix."""
    return xxhash.xxh64(model_revision.encode()).intdigest()
