"""The prompts of OpenAI request bodies: token ids, texts through the model's tokenizer, chat messages through its chat
template, and stop strings; ApiError (a 400) naming the field otherwise. Used by openai_api.parse."""
from __future__ import annotations

import numpy as np

from flame_llm.serving.openai_errors import ApiError, short

MAX_STOP_STRINGS = 16
MAX_INT64 = (1 << 63) - 1
FALLBACK_CHARS_PER_TOKEN = 64  # a tokenizer whose vocabulary cannot be listed: a generous bound on a token's text


def longest_token_chars(tokenizer) -> int:
    """The characters of the tokenizer's longest vocabulary entry (added tokens included): no token covers more
    of a text, so a text of c characters is at least c / this many tokens. Byte-level vocabularies spell a byte
    as one character, so a multi-byte character counts as several here: the bound only grows."""
    try:
        return max(1, max(len(t) for t in tokenizer.get_vocab()))
    except Exception:  # noqa: BLE001 - no listable vocabulary: the generous constant
        return FALLBACK_CHARS_PER_TOKEN


def max_text_chars(max_model_len: int, tokenizer) -> int:
    """The longest text (characters) that could still fit in max_model_len tokens: a longer one is refused
    before it is tokenized (a 15 MB text took the event loop 21 s and 1.2 GB to tokenize before its 400)."""
    return max_model_len * (longest_token_chars(tokenizer) if tokenizer is not None else FALLBACK_CHARS_PER_TOKEN)


def has_text(kind: str, body: object) -> bool:
    """Whether parsing the body tokenizes text (chat messages, a text prompt or a list with one): the front doors
    parse such a body off the event loop."""
    if kind == "chat":
        return True
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, str):
        return True
    # token ids (a flat list of ints, perhaps 1M long) are not scanned: only a list of prompts is
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int) \
        and any(isinstance(p, str) for p in prompt)


def check_text_chars(field: str, chars: int, limit: int | None) -> None:
    """A 400 naming the field when a text of `chars` characters is past `limit` (max_text_chars)."""
    if limit is not None and chars > limit:
        raise ApiError(400, f"field {field!r}: the text is {chars} characters; at most {limit} can fit in this "
                            "model's maximum context length (max_model_len tokens x the tokenizer's longest token)",
                       field, code="context_length_exceeded")


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


def completion_prompts(prompt: object, tokenizer, vocab_size: int, text_limit: int | None = None) -> list[np.ndarray]:
    """The prompts of a completions body; a text longer than text_limit characters is a 400 before any is
    tokenized."""
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
    for p in prompts:
        if isinstance(p, str):
            check_text_chars("prompt", len(p), text_limit)
    return [_tokenized(p, tokenizer) if isinstance(p, str) else p for p in prompts]


def _tokenized(text: str, tokenizer) -> np.ndarray:
    if tokenizer is None:
        raise ApiError(400, "field 'prompt': text prompts need a tokenizer, and the model directory has none; "
                            "send token ids", "prompt")
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def chat_prompt(messages: object, tokenizer, text_limit: int | None = None) -> np.ndarray:
    """The prompt of chat messages through the chat template; contents longer than text_limit characters in all
    are a 400 before the template runs (the template only adds to them)."""
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
    check_text_chars("messages", sum(len(m["content"]) for m in plain), text_limit)
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
