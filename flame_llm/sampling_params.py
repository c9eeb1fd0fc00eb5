from __future__ import annotations

from dataclasses import dataclass

from flame_llm.validate import FieldError, brief, check, check_bool, check_int, check_number, is_int

__all__ = ["SamplingParams", "SamplingParamsError", "brief"]  # brief: the protocol's error messages import it here

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
        check(isinstance(stop, (list, tuple)), "stop_token_ids", "a list or tuple of token ids", stop, **_WHERE)
        self.stop_token_ids = tuple(stop)
        self.validate()

    def validate(self) -> None:
        """Raise SamplingParamsError (a ValueError) naming the field and its limit."""
        t, k, p, n, seed = self.temperature, self.top_k, self.top_p, self.max_tokens, self.seed
        stop = self.stop_token_ids
        check_number("temperature", t, 0, MAX_TEMPERATURE, limit=_LIMITS["temperature"], **_WHERE)
        if k != -1 or not is_int(k):
            check_int("top_k", k, 1, MAX_TOP_K, limit=_LIMITS["top_k"], **_WHERE)
        check_number("top_p", p, 0, 1, low_open=True, limit="in (0, 1]", **_WHERE)
        check_int("max_tokens", n, 1, MAX_OUTPUT_TOKENS, limit=_LIMITS["max_tokens"], **_WHERE)
        check_bool("ignore_eos", self.ignore_eos, **_WHERE)
        check(isinstance(stop, tuple) and len(stop) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", _LIMITS["stop"], stop,
              **_WHERE)
        if stop:
            check(all(is_int(x) and 0 <= x < TOKEN_ID_LIMIT for x in stop), "stop_token_ids",
                  "non-negative integers < 2**32", stop, **_WHERE)
        check_int("seed", seed, 0, SEED_LIMIT - 1, optional=True, limit="None or an integer in [0, 2**63)", **_WHERE)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SamplingParamsError(FieldError):
    """A sampling parameter outside its limits; `field` names it (front doors report it without parsing)."""


_WHERE = {"where": "sampling parameter", "error": SamplingParamsError}


def stop_reason(token_id: int, sp: SamplingParams, eos_token_ids: frozenset[int], num_completion_tokens: int,
                num_tokens: int, max_model_len: int) -> str | None:
    """Whether appending token_id, the request's num_completion_tokens-th output token (num_tokens in all with the
    prompt), ends it: "stop" (an EOS id of the model unless ignore_eos, or one of its stop token ids), "length"
    (max_tokens or max_model_len reached), or None. The one stop rule: the engine's (engine/commit.py) and a
    resuming client's (serving/retry.py)."""
    if (not sp.ignore_eos and token_id in eos_token_ids) or token_id in sp.stop_token_ids:
        return "stop"
    if num_completion_tokens >= sp.max_tokens or num_tokens >= max_model_len:
        return "length"
    return None

