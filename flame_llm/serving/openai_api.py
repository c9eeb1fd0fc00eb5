"""The OpenAI protocol of both HTTP front doors (the service's and serve-http's): request bodies of
/v1/completions and /v1/chat/completions checked into prompts and sampling parameters, and the responses and
stream chunks built from results. One module, so the two servers cannot drift.

Supported: token-id prompts, text prompts and chat messages when the model has a tokenizer (chat needs its chat
template), batched prompts, `n`, `max_tokens` (`max_completion_tokens`), `temperature`, `top_p`, `top_k`,
`seed`, `stop` (strings), `stop_token_ids`, `ignore_eos`, `stream`, `stream_options.include_usage`, and `user`
(an end-user id, recorded nowhere). Any other field, or a supported one at a value we cannot honour
(`logprobs`, `echo`, penalties, `logit_bias`, tools, ...), is a 400 naming it: never silently ignored.
A request larger than the server's limits (prompts, or prompt plus output tokens over its choices) is a 413;
`max_tokens` beyond the room the prompt leaves in max_model_len is a 400, as vLLM answers."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from flame_llm.protocol.types import EngineLimits, ErrorCode, RequestError, sampling_from_map
from flame_llm.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the room left)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")
COMMON_KEYS = {"model", "n", "max_tokens", "stop", "stream", "stream_options", "user", *SAMPLING_KEYS}
# fields accepted only at the value that means "off" (anything else is a 400 naming the field)
OFF_VALUES = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
              "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
              "suffix": (None, ""), "return_token_ids": (None, True, False), "tools": (None, []),
              "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
              "parallel_tool_calls": (None, False), "response_format": (None, {"type": "text"})}
COMPLETION_KEYS = COMMON_KEYS | {"prompt", "logprobs", "echo", "best_of", "presence_penalty", "frequency_penalty",
                                 "logit_bias", "suffix", "return_token_ids"}
CHAT_KEYS = COMMON_KEYS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "presence_penalty",
                           "frequency_penalty", "logit_bias", "tools", "tool_choice", "functions", "function_call",
                           "parallel_tool_calls", "response_format"}


# an HTTP error's `code` when nothing more specific is known: always a string, as OpenAI's are (the protocol's
# ErrorCode values, "model_not_found", "invalid_api_key" and "context_length_exceeded" are the specific ones);
# where the protocol has the code (400), it is the protocol's ErrorCode value, not a second spelling of it
STATUS_CODES = {400: ErrorCode.INVALID_REQUEST.value, 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
                405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large", 500: "internal_error",
                503: "service_unavailable"}
MAX_INT64 = (1 << 63) - 1
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


@dataclass(slots=True)
class RequestLimits:
    """What one HTTP request may ask for (the `http` section's per-request limits)."""
    max_prompts: int  # prompts x n
    max_tokens: int  # prompt plus max output tokens, summed over the choices


@dataclass(slots=True)
class ApiRequest:
    """A checked request: one prompt and sampling per choice (n choices per prompt, in OpenAI's index order)."""
    kind: str  # "completion" | "chat"
    prompts: list[np.ndarray]
    sampling: list[SamplingParams]
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    id: str = ""
    created: int = 0


def parse(kind: str, body: object, engine: EngineLimits, limits: RequestLimits, tokenizer=None,
          model_names: tuple[str, ...] = ()) -> ApiRequest:
    """The request of a completions ("completion") or chat ("chat") body; ApiError naming the field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object; got {type(body).__name__}", "body")
    allowed = COMPLETION_KEYS if kind == "completion" else CHAT_KEYS
    unknown = sorted(str(k) for k in body if k not in allowed)
    if unknown:
        raise ApiError(400, f"unrecognized field(s) {unknown[:8]}; this server takes: {', '.join(sorted(allowed))}",
                       unknown[0])
    for name, off in OFF_VALUES.items():
        if name in body and not any(body[name] is v if v is None else type(body[name]) is type(v) and body[name] == v
                                    for v in off):
            raise ApiError(400, f"field {name!r} is not supported (accepted only as "
                                f"{' or '.join(json.dumps(v) for v in off)}); got {_short(body[name])}", name)
    model = body.get("model")
    if model is not None and model_names and model not in model_names:
        raise ApiError(404, f"the model {_short(model)} does not exist; this server serves {model_names[0]!r}",
                       "model", code="model_not_found")
    if kind == "completion":
        if "prompt" not in body:
            raise ApiError(400, "field 'prompt' is required", "prompt")
        prompts = _completion_prompts(body["prompt"], tokenizer, engine.vocab_size)
    else:
        prompts = [_chat_prompt(body.get("messages"), tokenizer)]
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise ApiError(400, f"field 'n' must be an integer >= 1; got {_short(n)}", "n")
    if len(prompts) * n > limits.max_prompts:
        raise ApiError(413, f"the request asks for {len(prompts)} prompt(s) x n={n} = {len(prompts) * n} "
                            f"completions; the limit is {limits.max_prompts} per request (max_prompts_per_request)",
                       "prompt")
    for p in prompts:
        try:
            engine.check_prompt(p)
        except RequestError as e:
            raise ApiError(400, f"field 'prompt': {e}", "prompt", code=e.code.value) from None
    stop = _stop_strings(body.get("stop"), tokenizer)
    stream, options = body.get("stream", False), body.get("stream_options")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, f"field 'stream' must be true or false; got {_short(stream)}", "stream")
    include_usage = False
    if options is not None:
        if not stream or not isinstance(options, dict) or set(options) - {"include_usage"} \
                or not isinstance(options.get("include_usage", False), bool):
            raise ApiError(400, "field 'stream_options' must be {\"include_usage\": true|false}, with stream: true; "
                                f"got {_short(options)}", "stream_options")
        include_usage = options.get("include_usage", False)
    max_key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(max_key)
    sampling, total = [], 0
    for p in prompts:
        room = engine.max_model_len - len(p)
        mt = max_tokens
        if mt is None:
            mt = min(COMPLETIONS_DEFAULT_MAX_TOKENS, room) if kind == "completion" else room
        sp = _sampling({**{k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None}, "max_tokens": mt},
                       max_key)
        if sp.max_tokens > room:
            raise ApiError(400, f"this model's maximum context length is {engine.max_model_len} tokens; the prompt "
                                f"has {len(p)} tokens and {max_key} is {sp.max_tokens} ({len(p) + sp.max_tokens} in "
                                f"all): at most {room} tokens can be generated", max_key,
                           code="context_length_exceeded")
        for k in range(n):
            seeded = sp if sp.seed is None or k == 0 else SamplingParams(
                **{**_fields(sp), "seed": (sp.seed + k) % (1 << 63)})
            sampling.append(seeded)
            total += len(p) + sp.max_tokens
    if total > limits.max_tokens:
        raise ApiError(413, f"the request asks for {total} tokens (prompt plus {max_key}, over its "
                            f"{len(sampling)} completions); the limit is {limits.max_tokens} per request "
                            "(max_tokens_per_request)", max_key)
    expanded = [p for p in prompts for _ in range(n)]
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    return ApiRequest(kind, expanded, sampling, stop, stream, include_usage, f"{prefix}-{uuid.uuid4().hex[:24]}",
                      int(time.time()))


def _fields(sp: SamplingParams) -> dict:
    return {f: getattr(sp, f) for f in SamplingParams.__dataclass_fields__}


def _sampling(m: dict, max_key: str) -> SamplingParams:
    try:
        return sampling_from_map(m)
    except RequestError as e:
        param = max_key if e.field == "max_tokens" else e.field
        raise ApiError(400, str(e).replace("'max_tokens'", repr(max_key)), param, code=e.code.value) from None


def _short(v: object, width: int = 60) -> str:
    try:
        s = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        s = type(v).__name__
    return s if len(s) <= width else s[:width] + "..."


def _token_array(p: object, vocab_size: int) -> np.ndarray | None:
    """p as an int64 array when it is a non-empty list of ints >= 0 (bools are not ints here), else None; an id
    past int64 is a 400 here (the vocabulary check comes later, on the array). C-level passes only: an 8K-token
    prompt costs ~0.4 ms of the event loop's GIL, not ~1.5 ms."""
    if not isinstance(p, list) or not p or set(map(type, p)) != {int} or min(p) < 0:
        return None
    top = max(p)
    if top > MAX_INT64:
        raise ApiError(400, f"field 'prompt': token id {top} at position {p.index(top)} is >= vocab_size "
                            f"{vocab_size}", "prompt", code="token_out_of_range")
    return np.fromiter(p, dtype=np.int64, count=len(p))


def _completion_prompts(prompt: object, tokenizer, vocab_size: int) -> list[np.ndarray]:
    one = prompt if isinstance(prompt, str) else _token_array(prompt, vocab_size)
    if one is not None:
        prompts = [one]
    elif isinstance(prompt, list) and prompt:
        prompts = [p if isinstance(p, str) else _token_array(p, vocab_size) for p in prompt]
    else:
        prompts = [None]
    if any(p is None for p in prompts):
        raise ApiError(400, "field 'prompt' must be a non-empty list of token ids (integers >= 0), a list of such "
                            f"lists, text, or a list of texts; got {_short(prompt)}", "prompt")
    return [_tokenized(p, tokenizer) if isinstance(p, str) else p for p in prompts]


def _tokenized(text: str, tokenizer) -> np.ndarray:
    if tokenizer is None:
        raise ApiError(400, "field 'prompt': text prompts need a tokenizer, and the model directory has none; "
                            "send token ids", "prompt")
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def _chat_prompt(messages: object, tokenizer) -> np.ndarray:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and _content(m.get("content")) is not None
        for m in messages)
    if not ok:
        raise ApiError(400, "field 'messages' must be a non-empty list of {\"role\": str, \"content\": str or a "
                            f"list of text parts}}; got {_short(messages)}", "messages")
    if tokenizer is None:
        raise ApiError(400, "chat completions need a tokenizer with a chat template; the model directory has no "
                            "tokenizer (use /v1/completions with token ids)", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "the model's tokenizer has no chat template, so chat messages cannot be turned into a "
                            "prompt; use /v1/completions", "messages")
    plain = [{"role": m["role"], "content": _content(m["content"])} for m in messages]
    try:
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # the template's own checks (roles, order): the request's fault
        raise ApiError(400, f"field 'messages': the chat template refused them ({type(e).__name__}: {e})",
                       "messages") from None
    if not isinstance(ids, list):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return np.asarray(ids, dtype=np.int64)


def _content(c: object) -> str | None:
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "".join(p["text"] for p in c)
    return None


def _stop_strings(stop: object, tokenizer) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and s for s in stops)):
        ids = isinstance(stops, list) and any(isinstance(s, int) and not isinstance(s, bool) for s in stops)
        raise ApiError(400, f"field 'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                            f"non-empty strings; got {_short(stop)}"
                            f"{' (stop token ids go in stop_token_ids)' if ids else ''}", "stop")
    if stops and tokenizer is None:
        raise ApiError(400, "field 'stop': stop strings need a tokenizer, and the model directory has none; use "
                            "stop_token_ids", "stop")
    return stops


# --- responses ---

def usage(results: list[dict]) -> dict:
    prompt = sum(r["prompt_tokens"] for r in results)
    out = sum(len(r["output_token_ids"]) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": sum(r["cached_tokens"] for r in results)}}


def response(req: ApiRequest, model: str, results: list[dict], texts: list[str], server_s: float) -> dict:
    """The whole response of a non-streamed request (results and texts in choice order)."""
    if req.kind == "completion":
        choices = [{"index": k, "text": t, "token_ids": r["output_token_ids"], "logprobs": None,
                    "finish_reason": r["finish_reason"]} for k, (r, t) in enumerate(zip(results, texts))]
    else:
        choices = [{"index": k, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": r["finish_reason"], "token_ids": r["output_token_ids"]}
                   for k, (r, t) in enumerate(zip(results, texts))]
    timings = results[0]["timings"] if len(results) == 1 else {}
    return {"id": req.id, "object": "text_completion" if req.kind == "completion" else "chat.completion",
            "created": req.created, "model": model, "choices": choices, "usage": usage(results),
            "flame": {"device": ",".join(sorted({r["device"] for r in results})),
                      "node": ",".join(sorted({r["node"] for r in results})),
                      "shards": [r["shard"] for r in results],
                      "prompt_digests": [r["prompt_digest"] for r in results], "server_s": server_s,
                      "ttft": timings.get("ttft"), "tpot": timings.get("tpot")}}


def chunk(req: ApiRequest, model: str, index: int, text: str, token_ids: list[int], finish: str | None,
          first: bool = False) -> dict:
    """One server-sent event of a streamed request: one choice's new text and token ids."""
    if req.kind == "completion":
        choice = {"index": index, "text": text, "token_ids": token_ids, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    else:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or not first else {})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": token_ids}
        obj = "chat.completion.chunk"
    return {"id": req.id, "object": obj, "created": req.created, "model": model, "choices": [choice]}


def usage_chunk(req: ApiRequest, model: str, results: list[dict]) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": req.id, "object": obj, "created": req.created, "model": model, "choices": [],
            "usage": usage(results)}


def result_error(r: dict) -> ApiError:
    """The HTTP error for a failed result: 503 for a passing failure (retryable), 400 for the request's own fault,
    else 500."""
    err = r["error"]
    code = ErrorCode(err["code"])
    status = 503 if code.retryable else 400 if code in REQUEST_FAULTS else 500
    kind = "invalid_request_error" if status == 400 else "server_error"
    return ApiError(status, f"{err['code']}: {err['message']}", None, kind, err["code"])
