"""The client's one retry policy, for batched and streamed requests alike: what happens to a request after its
shard answered (or died under it). The rules (flame_llm.protocol.errors.RETRYABLE says which errors a resend
can cure):

- an answer without error, or with one a resend cannot cure, is the request's result (DONE);
- a request whose tokens were already streamed to its caller is not sent again as it was: its shard's error is its
  result; after its shard's death, once the shard is back (or given up on), its continuation is routed again
  (RESTART; the original prompt plus the streamed tokens, for the tokens still to come: `continuation` below), or,
  when the streamed tokens already ended it (a stop token, max_tokens, max_model_len), the streamed tokens are its
  result (DONE with that finish reason);
- overloaded: sent again after the shard's retry hint (RETRY) while that is before the request's overload deadline
  (Pending.deadline, the caller's choice); past it, `overloaded` is its result. Not counted against max_retries: a
  busy shard is waited for, not given up on;
- draining (or another retryable error from the shard): routed to another shard (REROUTE), the shard avoided;
- its shard died: once the shard is back (or given up on), routed again (RESTART);
- REROUTE and RESTART count against max_retries; past them the error is the result (FAIL for a death).

Each shard's ShardChannel (channel.py) carries the decisions out, for its batches and with the Dispatcher
(dispatch.py) for streams. Each send after the first goes under its own id (pending.attempt_id): the attempt before
it may still be on its shard, being aborted, when it arrives.

Resuming a stream whose shard died after some of its tokens reached the caller (when to do it is decide's rule,
dispatch.py carries it out): the continuation is the caller's request with the k streamed tokens appended to
its prompt and max_tokens reduced by k; everything else (stop token ids, ignore_eos, temperature, top-k/top-p) is
unchanged, and prompt + max_tokens is the same total, so it fits the engine's max_model_len exactly as the original
did. The caller's stream continues with the continuation's tokens.

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
import time
from dataclasses import dataclass
from enum import Enum

import numpy as np

from flame_llm.protocol.errors import ErrorCode, ErrorInfo
from flame_llm.protocol.types import Request, Result
from flame_llm.sampling_params import SEED_LIMIT, stop_reason
from flame_llm.serving.pending import Pending


class Action(str, Enum):
    DONE = "done"  # the result goes to the caller
    RETRY = "retry"  # the same shard again after delay_s
    REROUTE = "reroute"  # another shard: this one is avoided
    RESTART = "restart"  # the shard died: wait for it (or give it up), then route again
    FAIL = "fail"  # the caller gets `error`


@dataclass(slots=True, frozen=True)
class Decision:
    action: Action
    delay_s: float = 0.0  # RETRY: how long to wait first
    error: ErrorInfo | None = None  # FAIL: what the caller gets
    finish_reason: str | None = None  # DONE for a lost stream that already had all its tokens: how it ended


DONE = Decision(Action.DONE)


def decide(p: Pending, max_retries: int, result: Result | None = None, lost: BaseException | None = None,
           shard: int = -1, streamed: bool = False, now: float | None = None,
           complete: str | None = None) -> Decision:
    """What to do with `p` after `result` came back from `shard`, or after the shard died (`lost`, the error it
    died with). `streamed`: tokens of this attempt already reached the caller. `now`: time.monotonic().
    A stream that lost its shard after some tokens is resumed; `complete`: the finish reason its streamed
    tokens already reached (stream_end), if any."""
    retries = p.attempts - p.overloads  # waiting out an overloaded shard is no retry
    if lost is not None:
        if streamed and complete is not None:  # nothing is left to make: no resend
            return Decision(Action.DONE, finish_reason=complete)
        if retries >= max_retries:
            why = "streaming" if streamed else "serving"
            msg = f"shard {shard} died while {why} this request, {retries + 1} times: {type(lost).__name__}: {lost}"
            return Decision(Action.FAIL, error=ErrorInfo(ErrorCode.SHARD_DIED, msg))
        return Decision(Action.RESTART)
    assert result is not None
    err = result.error
    if err is None or not err.code.retryable or streamed:
        return DONE
    if err.code is ErrorCode.OVERLOADED:
        delay = err.retry_after_s or 0.0
        now = time.monotonic() if now is None else now
        return Decision(Action.RETRY, delay) if now + delay < p.deadline else DONE
    return Decision(Action.REROUTE) if retries < max_retries else DONE


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
