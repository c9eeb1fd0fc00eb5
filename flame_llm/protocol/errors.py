"""The protocol's errors: every code a request or a batch can fail with (and which of them a resend can cure:
ErrorCode.retryable, the client's retry policy and callers both read it), the exceptions that carry them (a
whole payload: WireError; one request: RequestError) and the error map of a result record (ErrorInfo)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from flame_llm.protocol.checks import finite
from flame_llm.sampling_params import brief

MAX_RETRY_AFTER_S = 3600.0  # the longest retry hint a result may carry


class ErrorCode(str, Enum):
    """Every way a request or a batch can fail; the value is what travels and what callers see."""
    # the whole payload is unusable (WireError)
    BAD_ZSTD = "bad_zstd"
    OVER_BUDGET = "over_budget"
    BAD_MSGPACK = "bad_msgpack"
    BAD_SCHEMA = "bad_schema"
    BAD_VERSION = "bad_version"
    WRONG_REVISION = "wrong_revision"
    BAD_RESULT = "bad_result"
    # one request is invalid at entry (RequestError)
    BAD_REQUEST = "bad_request"
    BAD_ID = "bad_id"
    DUPLICATE_ID = "duplicate_id"
    EMPTY_PROMPT = "empty_prompt"
    BAD_PROMPT = "bad_prompt"
    TOKEN_OUT_OF_RANGE = "token_out_of_range"
    PROMPT_TOO_LONG = "prompt_too_long"
    BAD_SAMPLING = "bad_sampling"
    # from the engine actor
    OVERLOADED = "overloaded"  # the admission queue is full; retry_after_s says when to come back
    DRAINING = "draining"  # the shard takes no new requests; another shard can serve them
    INVALID_REQUEST = "invalid_request"  # the engine's own checks (e.g. the request needs more KV than the pool)
    ENGINE_ERROR = "engine_error"
    # from the client
    ROUTER_ERROR = "router_error"  # the router did not answer (it restarts on its own: Ray max_restarts=-1)
    SHARD_UNAVAILABLE = "shard_unavailable"  # its shard died and did not come back, and no other shard took it
    SHARD_DIED = "shard_died"  # shards died under this request more than max_retries times
    CLIENT_ERROR = "client_error"
    # the bench's HTTP client
    HTTP_ERROR = "http_error"

    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def retryable(self) -> bool:
        """The request itself was fine: sent again (later, or to another shard) it can succeed."""
        return self in RETRYABLE


RETRYABLE = frozenset({ErrorCode.OVERLOADED, ErrorCode.DRAINING, ErrorCode.ROUTER_ERROR,
                       ErrorCode.SHARD_UNAVAILABLE})


class WireError(ValueError):
    """A whole payload is unusable; `code` is one of the payload-level codes."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class RequestError(ValueError):
    """One request is invalid: its `code`, the request `field` at fault and a message naming the field and
    the limit; `id` is the request's id when it is known."""

    def __init__(self, code: ErrorCode, message: str, field: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.field, self.id = code, message, field, request_id

    def info(self) -> ErrorInfo:
        return ErrorInfo(self.code, self.message)


@dataclass(slots=True)
class ErrorInfo:
    """The error of a result record."""
    code: ErrorCode
    message: str
    retry_after_s: float | None = None

    def to_dict(self) -> dict:
        """The error map, on the wire and in the client's result dicts."""
        return {"code": self.code.value, "message": self.message, "retry_after_s": self.retry_after_s}

    @classmethod
    def from_dict(cls, m: Any, where: str) -> ErrorInfo:
        ok = (isinstance(m, dict) and set(m) == {"code", "message", "retry_after_s"} and isinstance(m["code"], str)
              and isinstance(m["message"], str) and isinstance(m["retry_after_s"], (int, float, type(None))))
        if not ok:
            raise WireError(ErrorCode.BAD_RESULT, f"{where} error must be a map {{code: str, message: str, "
                                                  f"retry_after_s: number or None}}; got {brief(m, 120)}")
        try:
            code = ErrorCode(m["code"])
        except ValueError:
            raise WireError(ErrorCode.BAD_RESULT, f"{where} error code {brief(m['code'], 40)} is not one of the "
                                                  "protocol's codes") from None
        retry = m["retry_after_s"]
        if retry is not None and not (finite(retry) and 0 <= retry <= MAX_RETRY_AFTER_S):
            raise WireError(ErrorCode.BAD_RESULT, f"{where} error retry_after_s must be None or a number in "
                                                  f"[0, {MAX_RETRY_AFTER_S:g}]; got {brief(retry, 40)}")
        return cls(code, m["message"], retry)
