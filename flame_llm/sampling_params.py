from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass

MAX_TEMPERATURE = 100.0
MAX_TOP_K = 2**31 - 1  # values above the vocabulary act as off
MAX_OUTPUT_TOKENS = 2**31 - 1  # max_tokens; the engine also stops at max_model_len
MAX_STOP_TOKEN_IDS = 256
TOKEN_ID_LIMIT = 2**32  # stop token ids are in [0, 2**32), like prompt token ids on the wire
SEED_LIMIT = 2**63
_LIMITS = {"temperature": f"a number in [0, {MAX_TEMPERATURE:g}]",
           "top_k": f"-1 (off) or an integer in [1, {MAX_TOP_K}] (above the vocabulary: off)",
           "max_tokens": f"an integer >= 1 and <= {MAX_OUTPUT_TOKENS}",
           "stop": f"at most {MAX_STOP_TOKEN_IDS} token ids"}


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        stop = self.stop_token_ids
        _need(isinstance(stop, (list, tuple)), "stop_token_ids", "a list or tuple of token ids", stop)
        self.stop_token_ids = tuple(stop)
        self.validate()

    def validate(self) -> None:
        """Raise SamplingParamsError (a ValueError) naming the field and its limit."""
        t, k, p, n, seed = self.temperature, self.top_k, self.top_p, self.max_tokens, self.seed
        stop = self.stop_token_ids
        _need(_number(t) and 0.0 <= t <= MAX_TEMPERATURE, "temperature", _LIMITS["temperature"], t)
        _need(_int(k) and (k == -1 or 1 <= k <= MAX_TOP_K), "top_k", _LIMITS["top_k"], k)
        _need(_number(p) and 0.0 < p <= 1.0, "top_p", "in (0, 1]", p)
        _need(_int(n) and 1 <= n <= MAX_OUTPUT_TOKENS, "max_tokens", _LIMITS["max_tokens"], n)
        _need(isinstance(self.ignore_eos, bool), "ignore_eos", "true or false", self.ignore_eos)
        _need(isinstance(stop, tuple) and len(stop) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", _LIMITS["stop"], stop)
        if stop:
            _need(all(_int(x) and 0 <= x < TOKEN_ID_LIMIT for x in stop), "stop_token_ids",
                  "non-negative integers < 2**32", stop)
        _need(seed is None or (_int(seed) and 0 <= seed < SEED_LIMIT), "seed", "None or an integer in [0, 2**63)", seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SamplingParamsError(ValueError):
    """A sampling parameter outside its limits; `field` names it (front doors report it without parsing)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _int(v: object) -> bool:
    return type(v) is int or (isinstance(v, int) and not isinstance(v, bool))


def _number(v: object) -> bool:
    if type(v) is float:
        return math.isfinite(v)
    return _int(v) or (isinstance(v, float) and math.isfinite(v))  # an int is finite (maybe too large for a float)


def _need(ok: bool, name: str, limit: str, value: object) -> None:
    if not ok:
        raise SamplingParamsError(name, f"sampling parameter {name!r} must be {limit}; got {brief(value)}")


def brief(value: object, width: int = 80) -> str:
    """repr(value) cut to about `width` characters, built without ever forming the full repr: a long,
    huge or deeply nested value (from the wire: 1,000 levels of lists) costs O(width), never a
    RecursionError. Containers show their first items and their size."""
    s = _brief(value, width, 2)
    return s if len(s) <= width else s[:width - 3] + "..."


def _brief(v: object, width: int, depth: int) -> str:
    if isinstance(v, bool) or v is None or isinstance(v, float):
        return repr(v)
    if isinstance(v, int):
        return repr(v) if v.bit_length() <= 256 else f"<int of {v.bit_length()} bits>"
    if isinstance(v, (str, bytes, bytearray)):
        s = repr(v[:width])
        return s if len(v) <= width else f"{s}... ({len(v)} in all)"
    if isinstance(v, (list, tuple, dict, set, frozenset)):
        name = type(v).__name__
        if depth == 0:
            return f"<{name} of {len(v)}>"
        items = v.items() if isinstance(v, dict) else v
        parts = []
        for item in itertools.islice(items, 8):
            parts.append(f"{_brief(item[0], 20, 0)}: {_brief(item[1], 20, depth - 1)}" if isinstance(v, dict)
                         else _brief(item, 20, depth - 1))
        more = f", ... ({len(v)} in all)" if len(v) > 8 else ""
        body = ", ".join(parts) + more
        if isinstance(v, list):
            return f"[{body}]"
        if isinstance(v, tuple):
            return f"({body}{',' if len(v) == 1 else ''})"
        return f"{{{body}}}" if isinstance(v, dict) or v else f"{name}()"
    if isinstance(v, numbers.Number):
        return repr(v)[:width]
    return f"<{type(v).__name__}>"
