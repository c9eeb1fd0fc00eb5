"""Value checks the protocol's types share: prompt digests and token-id bytes, UTF-8 sizes, finite
numbers, and map keys for error messages (bounded, like every value an error message shows: see
flame_llm.validate.brief)."""
from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from flame_llm.sampling_params import TOKEN_ID_LIMIT
from flame_llm.validate import brief, is_number


def prompt_digest(token_ids: list[int] | np.ndarray) -> str:
    """xxh64 over a prompt's little-endian uint32 ids: what served it, compared with what was sent."""
    return xxhash.xxh64(np.asarray(token_ids, dtype="<u4").tobytes()).hexdigest()


def token_bytes(token_ids: list[int] | np.ndarray, where: str) -> bytes:
    """Token ids as little-endian uint32 bytes; ValueError unless they are a flat sequence in [0, 2**32)."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.uint32:
        return token_ids.astype("<u4", copy=False).tobytes()
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{where} must be a flat sequence of integers; got dtype {arr.dtype}, shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= TOKEN_ID_LIMIT):
        raise ValueError(f"{where} must be in [0, 2**32); got min {arr.min()}, max {arr.max()}")
    return arr.astype("<u4").tobytes()


def fits_utf8(s: Any, max_bytes: int) -> bool:
    """s is a str of at most max_bytes UTF-8 bytes (encoded only when its length leaves a doubt)."""
    if not isinstance(s, str) or len(s) > max_bytes:
        return False
    return len(s) * 4 <= max_bytes or len(s.encode()) <= max_bytes


def key_list(m: dict | set, n: int = 8) -> str:
    """A map's keys for an error message: sorted, each cut short, the first n and the count."""
    names = sorted(brief(k, 40) for k in m)
    return "[" + ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "") + "]"


finite = is_number  # an int or a finite float, not a bool: the validators' one rule
