"""The prompts of OpenAI request bodies: token ids, texts through the model's tokenizer, chat messages through its chat
template, and stop strings; ApiError (a 400) naming the field otherwise. Used by openai_api.parse."""
from __future__ import annotations

import numpy as np

from flame_llm.serving.openai_errors import ApiError, short

MAX_STOP_STRINGS = 16
MAX_INT64 = (1 << 63) - 1


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


def completion_prompts(prompt: object, tokenizer, vocab_size: int) -> list[np.ndarray]:
    one = prompt if isinstance(prompt, str) else _token_array(prompt, vocab_size)
    if one is not None:
        prompts = [one]
    elif isinstance(prompt, list) and prompt:
        prompts = [p if isinstance(p, str) else _token_array(p, vocab_size) for p in prompt]
    else:
        prompts = [None]
    if any(p is None for p in prompts):
        raise ApiError(400, "field 'prompt' must be a non-empty list of token ids (integers >= 0), a list of such "
                            f"lists, text, or a list of texts; got {short(prompt)}", "prompt")
    return [_tokenized(p, tokenizer) if isinstance(p, str) else p for p in prompts]


def _tokenized(text: str, tokenizer) -> np.ndarray:
    if tokenizer is None:
        raise ApiError(400, "field 'prompt': text prompts need a tokenizer, and the model directory has none; "
                            "send token ids", "prompt")
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def chat_prompt(messages: object, tokenizer) -> np.ndarray:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and _content(m.get("content")) is not None
        for m in messages)
    if not ok:
        raise ApiError(400, "field 'messages' must be a non-empty list of {\"role\": str, \"content\": str or a "
                            f"list of text parts}}; got {short(messages)}", "messages")
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


def stop_strings(stop: object, tokenizer) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and s for s in stops)):
        ids = isinstance(stops, list) and any(isinstance(s, int) and not isinstance(s, bool) for s in stops)
        raise ApiError(400, f"field 'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                            f"non-empty strings; got {short(stop)}"
                            f"{' (stop token ids go in stop_token_ids)' if ids else ''}", "stop")
    if stops and tokenizer is None:
        raise ApiError(400, "field 'stop': stop strings need a tokenizer, and the model directory has none; use "
                            "stop_token_ids", "stop")
    return stops
