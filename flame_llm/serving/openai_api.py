"""The OpenAI protocol of both HTTP front doors (the service's and serve-http's): request bodies of
/v1/completions and /v1/chat/completions checked into prompts and sampling parameters, and the responses and
stream chunks built from results. One module, so the two servers cannot drift.

Supported: token-id prompts, text prompts and chat messages when the model has a tokenizer (chat needs its chat
template), batched prompts, `n`, `max_tokens` (`max_completion_tokens`), `temperature`, `top_p`, `top_k`,
`seed`, `stop` (strings), `stop_token_ids`, `ignore_eos`, `stream`, `stream_options.include_usage` and
`.continuous_usage_stats` (vLLM's: usage on every chunk), `repetition_penalty` at 1 (off: vLLM's benchmark client
sends it), and `user`
(an end-user id, at most 256 characters: the front door's turns for shard credit go by it, else by API key).
Any other field, or a supported one at a value we cannot honour (`logprobs`, `echo`, penalties, `logit_bias`,
tools, ...), is a 400 naming it: never silently ignored.
A request larger than the server's limits (prompts, or prompt plus output tokens over its choices) is a 413;
`max_tokens` beyond the room the prompt leaves in max_model_len is a 400, as vLLM answers."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from flame_llm.protocol.errors import RequestError
from flame_llm.protocol.types import EngineLimits, sampling_from_map
from flame_llm.sampling_params import SamplingParams

# the errors and the prompt parsing live beside this module; ApiError, STATUS_CODES and result_error stay
# importable from here (the front doors use api.ApiError)
from flame_llm.serving.openai_errors import STATUS_CODES as STATUS_CODES
from flame_llm.serving.openai_errors import ApiError, check_model, short
from flame_llm.serving.openai_errors import result_error as result_error
from flame_llm.serving.openai_prompts import chat_prompt, completion_prompts, stop_strings
from flame_llm.serving.openai_prompts import has_text as has_text

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the room left)
MAX_USER_CHARS = 256  # the `user` field (an end-user id)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")
COMMON_KEYS = {"model", "n", "max_tokens", "stop", "stream", "stream_options", "user", "repetition_penalty",
               *SAMPLING_KEYS}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")  # stream_options' keys (booleans)
# fields accepted only at the value that means "off" (anything else is a 400 naming the field)
OFF_VALUES = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
              "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
              "repetition_penalty": (None, 1, 1.0),
              "suffix": (None, ""), "return_token_ids": (None, True, False), "tools": (None, []),
              "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
              "parallel_tool_calls": (None, False), "response_format": (None, {"type": "text"})}
COMPLETION_KEYS = COMMON_KEYS | {"prompt", "logprobs", "echo", "best_of", "presence_penalty", "frequency_penalty",
                                 "logit_bias", "suffix", "return_token_ids"}
CHAT_KEYS = COMMON_KEYS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "presence_penalty",
                           "frequency_penalty", "logit_bias", "tools", "tool_choice", "functions", "function_call",
                           "parallel_tool_calls", "response_format"}


@dataclass(slots=True)
class RequestLimits:
    """What one HTTP request may ask for (the `http` section's per-request limits)."""
    max_prompts: int  # prompts x n
    max_tokens: int  # prompt plus max output tokens, summed over the choices
    max_text_chars: int | None = None  # a longer text prompt is a 400 before tokenizing (openai_prompts.max_text_chars)


@dataclass(slots=True)
class ApiRequest:
    """A checked request: one prompt and sampling per choice (n choices per prompt, in OpenAI's index order)."""
    kind: str  # "completion" | "chat"
    prompts: list[np.ndarray]
    sampling: list[SamplingParams]
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    id: str = ""
    created: int = 0
    user: str = ""  # the end user the request is for ("" when not given)


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
                                f"{' or '.join(json.dumps(v) for v in off)}); got {short(body[name])}", name)
    check_model(body.get("model"), model_names)
    if kind == "completion":
        if "prompt" not in body:
            raise ApiError(400, "field 'prompt' is required", "prompt")
        prompts = completion_prompts(body["prompt"], tokenizer, engine.vocab_size, limits.max_text_chars)
    else:
        prompts = [chat_prompt(body.get("messages"), tokenizer, limits.max_text_chars)]
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise ApiError(400, f"field 'n' must be an integer >= 1; got {short(n)}", "n")
    if len(prompts) * n > limits.max_prompts:
        raise ApiError(413, f"the request asks for {len(prompts)} prompt(s) x n={n} = {len(prompts) * n} "
                            f"completions; the limit is {limits.max_prompts} per request (max_prompts_per_request)",
                       "prompt")
    for p in prompts:  # the one check of the prompts (the client takes them as checked: pending.CheckedPrompt)
        try:
            engine.check_prompt(p)
        except RequestError as e:
            raise ApiError(400, f"field 'prompt': {e}", "prompt", code=e.code.value) from None
    prompts = [p.astype(np.uint32) for p in prompts]
    stop = stop_strings(body.get("stop"), tokenizer)
    stream, options = body.get("stream", False), body.get("stream_options")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, f"field 'stream' must be true or false; got {short(stream)}", "stream")
    include_usage = continuous_usage = False
    if options is not None:
        if not stream or not isinstance(options, dict) or set(options) - set(STREAM_OPTIONS) \
                or not all(isinstance(options.get(k, False), bool) for k in STREAM_OPTIONS):
            raise ApiError(400, "field 'stream_options' must be {\"include_usage\": true|false, "
                                "\"continuous_usage_stats\": true|false}, with stream: true; "
                                f"got {short(options)}", "stream_options")
        include_usage, continuous_usage = (options.get(k, False) for k in STREAM_OPTIONS)
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
    user = body.get("user")
    if user is None:
        user = ""
    if not isinstance(user, str) or len(user) > MAX_USER_CHARS:
        raise ApiError(400, f"field 'user' must be a string of at most {MAX_USER_CHARS} characters; got {short(user)}",
                       "user")
    expanded = [p for p in prompts for _ in range(n)]
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    return ApiRequest(kind, expanded, sampling, stop, stream, include_usage, continuous_usage,
                      f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time()), user)


def _fields(sp: SamplingParams) -> dict:
    return {f: getattr(sp, f) for f in SamplingParams.__dataclass_fields__}


def _sampling(m: dict, max_key: str) -> SamplingParams:
    try:
        return sampling_from_map(m)
    except RequestError as e:
        param = max_key if e.field == "max_tokens" else e.field
        raise ApiError(400, str(e).replace("'max_tokens'", repr(max_key)), param, code=e.code.value) from None


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
