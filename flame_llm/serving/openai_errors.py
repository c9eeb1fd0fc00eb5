"""The HTTP errors of the OpenAI front doors, in OpenAI's shape, with string codes that are the protocol's ErrorCode
values wherever it has one (flame_llm/serving/openai_api.py parses requests; this is what it and the servers raise)."""
from __future__ import annotations

import json

from flame_llm.protocol.errors import ErrorCode

# an HTTP error's `code` when nothing more specific is known: always a string, as OpenAI's are (the protocol's
# ErrorCode values, "model_not_found", "invalid_api_key" and "context_length_exceeded" are the specific ones);
# where the protocol has the code (400), it is the protocol's ErrorCode value, not a second spelling of it
STATUS_CODES = {400: ErrorCode.INVALID_REQUEST.value, 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
                405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large", 500: "internal_error",
                503: "service_unavailable"}
# failed results that are the request's own fault: a 400 (other non-retryable failures are a 500)
REQUEST_FAULTS = frozenset({ErrorCode.BAD_REQUEST, ErrorCode.BAD_PROMPT, ErrorCode.EMPTY_PROMPT,
                            ErrorCode.TOKEN_OUT_OF_RANGE, ErrorCode.PROMPT_TOO_LONG, ErrorCode.BAD_SAMPLING,
                            ErrorCode.INVALID_REQUEST, ErrorCode.OVER_BUDGET})


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, `code` a string."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code = str(code) if code is not None else STATUS_CODES.get(status, f"http_{status}")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def short(v: object, width: int = 60) -> str:
    """v as JSON for an error message, cut at `width` characters."""
    try:
        s = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        s = type(v).__name__
    return s if len(s) <= width else s[:width] + "..."


def check_model(model: object, model_names: tuple[str, ...]) -> None:
    """A 404 when a body's `model` names a model this server does not serve (absent or null: the served one)."""
    if model is not None and model_names and model not in model_names:
        raise ApiError(404, f"the model {short(model)} does not exist; this server serves {model_names[0]!r}",
                       "model", code="model_not_found")


def result_error(r: dict) -> ApiError:
    """The HTTP error for a failed result: 503 for a passing failure (retryable), 400 for the request's own fault,
    else 500."""
    err = r["error"]
    code = ErrorCode(err["code"])
    status = 503 if code.retryable else 400 if code in REQUEST_FAULTS else 500
    kind = "invalid_request_error" if status == 400 else "server_error"
    return ApiError(status, f"{err['code']}: {err['message']}", None, kind, err["code"])
