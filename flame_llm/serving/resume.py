"""Resuming a stream whose shard died after some of its tokens reached the caller (when to do it is retry.decide's
rule, client_stream.py carries it out). The continuation is the caller's request with
the k streamed tokens appended to its prompt and max_tokens reduced by k; everything else (stop token ids,
ignore_eos, temperature, top-k/top-p) is unchanged, and prompt + max_tokens is the same total, so it fits the
engine's max_model_len exactly as the original did. The caller's stream continues with the continuation's tokens.

A greedy request continues exactly as an uninterrupted run would. A sampled one continues as a valid sample of
its distribution but not the stream an uninterrupted run would have drawn: a seeded request's draws are keyed by
(seed, output position) in the engine's sampler, and the continuation's output positions restart at 0, so it
gets the seed `seed + k` (its keys cannot repeat one the first k tokens used: the same seed would draw the
first k tokens' randomness again, correlated with the prefix it conditions on). A resumed seeded stream is thus
reproducible only given the same death point.

A death after the last token reached the caller but before its result is told apart here (stream_end): the
model's EOS ids (each shard's health() publishes them; ignore_eos honoured), the request's stop token ids,
max_tokens and max_model_len; such a stream ends with what it had, with no continuation sent."""
from __future__ import annotations

import dataclasses

import numpy as np

from flame_llm.protocol.types import Request
from flame_llm.sampling_params import SEED_LIMIT, stop_reason


def stream_end(original: Request, streamed: list[int], max_model_len: int,
               eos_token_ids: frozenset[int] = frozenset()) -> str | None:
    """The finish reason the streamed tokens of `original` already reached ("stop": the last one is a stop token
    id, or an EOS id of the model unless ignore_eos; "length": max_tokens or max_model_len reached), or None: a
    continuation has tokens left to make: the engine's rule (sampling_params.stop_reason) on the last one."""
    k = len(streamed)
    if not k:
        return None
    return stop_reason(streamed[-1], original.sampling, eos_token_ids, k, len(original.prompt_token_ids) + k,
                       max_model_len)


def continuation(original: Request, streamed: list[int]) -> Request:
    """The request that makes the rest of `original` after the tokens `streamed` (a new Request: the caller's
    prompt and sampling params are not touched)."""
    sp, k = original.sampling, len(streamed)
    assert 0 < k < sp.max_tokens, "a continuation has streamed tokens behind it and tokens left to make"
    prompt = np.concatenate([np.asarray(original.prompt_token_ids, dtype=np.uint32),
                             np.asarray(streamed, dtype=np.uint32)])
    seed = None if sp.seed is None else (sp.seed + k) % SEED_LIMIT
    return Request(original.id, prompt, dataclasses.replace(sp, max_tokens=sp.max_tokens - k, seed=seed),
                   original.user)
