"""vLLM's POST /tokenize and /detokenize, on both front doors. `vllm bench serve` tokenizes its first prompt on the
server to check that its tokenizer and the server's count alike (on a mismatch it re-cuts every prompt through
/detokenize); without the routes it printed "/tokenize unavailable, skipping alignment" and measured unchecked.
The bodies are vLLM's: {"prompt": text, "add_special_tokens": true} or {"messages": [...]} (through the chat
template, as /v1/chat/completions makes its prompt) -> {"count", "max_model_len", "tokens", "token_strs"};
{"tokens": [ids]} -> {"prompt": text}. A field we do not implement is a 400 naming it, as on the other routes."""
from __future__ import annotations

from flame_llm.protocol.types import EngineLimits
from flame_llm.serving.openai_errors import ApiError, check_model, short
from flame_llm.serving.openai_prompts import chat_prompt, check_text_chars

TOKENIZE_KEYS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                           "return_token_strs"})
DETOKENIZE_KEYS = frozenset({"model", "tokens"})


def _object(body: object, allowed: frozenset[str]) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object; got {type(body).__name__}", "body")
    unknown = sorted(str(k) for k in body if k not in allowed)
    if unknown:
        raise ApiError(400, f"unrecognized field(s) {unknown[:8]}; this route takes: {', '.join(sorted(allowed))}",
                       unknown[0])
    return body


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"field {name!r} must be true or false; got {short(v)}", name)
    return v


def _need(tokenizer, route: str) -> None:
    if tokenizer is None:
        raise ApiError(400, f"{route} needs a tokenizer, and the model directory has none (set `tokenizer`, or "
                            "send token ids to /v1/completions)", None)


def tokenize(body: object, tokenizer, limits: EngineLimits, text_limit: int | None,
             model_names: tuple[str, ...] = ()) -> dict:
    """The response of POST /tokenize; ApiError naming the field otherwise. Runs the tokenizer: call it off the
    event loop."""
    body = _object(body, TOKENIZE_KEYS)
    check_model(body.get("model"), model_names)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise ApiError(400, "send exactly one of 'prompt' (text) and 'messages' (chat messages)",
                       "prompt" if has_prompt else "messages")
    _need(tokenizer, "/tokenize")
    strs = _flag(body, "return_token_strs", False)
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise ApiError(400, f"field 'prompt' must be text; got {short(prompt)}", "prompt")
        check_text_chars("prompt", len(prompt), text_limit)
        if "add_generation_prompt" in body:
            raise ApiError(400, "field 'add_generation_prompt' goes with 'messages', not 'prompt'",
                           "add_generation_prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        # the prompt /v1/chat/completions would make: the template with its generation prompt, no tokens added
        for name, only in (("add_generation_prompt", True), ("add_special_tokens", False)):
            if _flag(body, name, only) is not only:
                raise ApiError(400, f"field {name!r} is accepted only as {str(only).lower()} with 'messages' (the "
                                    "prompt chat completions make)", name)
        ids = chat_prompt(body["messages"], tokenizer, text_limit).tolist()
    return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if strs else None}


def detokenize(body: object, tokenizer, limits: EngineLimits, max_tokens: int,
               model_names: tuple[str, ...] = ()) -> dict:
    """The response of POST /detokenize: the text of token ids (at most max_tokens, the per-request token limit,
    each below the model's vocab_size); ApiError naming the field otherwise. Call it off the event loop."""
    body = _object(body, DETOKENIZE_KEYS)
    check_model(body.get("model"), model_names)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or set(map(type, tokens)) - {int} or (tokens and min(tokens) < 0):
        raise ApiError(400, f"field 'tokens' must be a list of token ids (integers >= 0); got {short(tokens)}",
                       "tokens")
    if len(tokens) > max_tokens:
        raise ApiError(413, f"field 'tokens' has {len(tokens)} ids; the limit is {max_tokens} per request "
                            "(max_tokens_per_request)", "tokens")
    if tokens and max(tokens) >= limits.vocab_size:
        top = max(tokens)
        raise ApiError(400, f"field 'tokens': token id {top} at position {tokens.index(top)} is >= vocab_size "
                            f"{limits.vocab_size}", "tokens", code="token_out_of_range")
    _need(tokenizer, "/detokenize")
    return {"prompt": tokenizer.decode(tokens)}
