"""One streamed request of the client (Client.stream, Client.stream_chunks): placed at once when the client knows
its prefix's shard (routing.py), else routed by the router's `route` call like a batch; encoded by the wire codec
as a batch of one, served over the client's TCP connection to the shard's stream server (stream_conn.py): token
chunks as the engine samples them, then the result payload.

What happens after an attempt is the batches' policy (flame_llm/serving/retry.py), carried out here with the
shard's channel (channel.py): until its first token arrives a stream is retried as a batch request is; after that
a shard's error ends it, and its shard's death sends its continuation once the shard is back or to another shard
(the original prompt plus the streamed tokens, retry.py): the caller's stream goes on with no token repeated or
skipped. Cancelling the task that runs it (the caller stopped reading) aborts it on its
shard."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass

from flame_llm.protocol.types import Request, Result, prompt_digest
from flame_llm.protocol.wire import request_wire_size
from flame_llm.serving.channel import SHARD_LOST, ShardChannel
from flame_llm.serving.dispatch import Dispatcher
from flame_llm.serving.pending import Pending, failed_result, set_estimates
from flame_llm.serving.retry import Action, continuation, decide, stream_end


@dataclass(slots=True)
class StreamChunk:
    """Token ids the shard sent at once; the last chunk of a stream carries its Result."""
    token_ids: list[int]
    result: Result | None = None


class StreamError(RuntimeError):
    """A streamed request failed; `result` is its Result (error code, message, tokens it had)."""

    def __init__(self, result: Result) -> None:
        err = result.error
        super().__init__(f"{err.code}: {err.message}")
        self.result = result


# the router hears of a stream placed here (place_stream) this long after its first token, once that token has
# reached the caller: the call takes ~0.5 ms of this loop, which a front door shares with the stream's SSE writer
# (told at once, it held the first token back ~0.5 ms at the door; bench/results/2026-12-01-cpu-hops-session3)
TELL_AFTER_S = 0.002


async def stream_request(d: Dispatcher, p: Pending, push: Callable[[StreamChunk], None]) -> Result:
    """Serve one prepared request `p` (not failed at entry) through dispatcher `d` on its loop, handing each token
    chunk to `push`; its Result (output_token_ids: what was streamed; prompt_tokens: the caller's prompt;
    timings["resumed"]: how many times it went on from its last token after its shard died, retry.py)."""
    rid, original, streamed = p.request.id, p.request, []
    resumed = 0
    split: dict[str, float] = {}  # the last attempt's route_s, credit_wait_s, sent_at, first_chunk_at_client
    while True:
        t0 = time.perf_counter()
        shard = d.routing.place_stream(p)
        untold = [p] if shard is not None else []  # placed here: the router is told after the first token (_tell)
        if shard is None:
            (shard,) = await d.route_shards([p])
        split["route_s"] = time.perf_counter() - t0
        if not isinstance(shard, int):  # the router is down, or no shard is left to serve it
            result = p.future.result()
            break
        payload = d.codec.encode([p])
        ch = d.channels[shard]
        r, lost, before = None, None, len(streamed)
        split.pop("first_chunk_at_client", None)  # this attempt's
        try:
            t0 = time.perf_counter()
            await ch.take(p.request.user)  # in its user's turn, as batches are
            split["credit_wait_s"] = time.perf_counter() - t0
            try:
                r = await _one_stream(d, ch, payload, streamed, push, split, untold)
            finally:
                ch.give()
        except SHARD_LOST as e:
            lost = e
        finally:
            if untold:  # before the completion or forget below
                d.routing.tell(untold.pop(), shard)
            if r is None:  # lost, cancelled (the caller left, a stop string) or failed: not answered there
                d.forget(shard, [p])
        if r is not None:
            d.complete(shard, [(p, r)])
        now_streamed = len(streamed) > before  # earlier attempts' tokens are in this attempt's prompt
        end = (stream_end(original, streamed, d.max_model_len, d.eos_token_ids)
               if lost is not None and now_streamed else None)
        decision = decide(p, d.max_retries, r, lost, shard, streamed=now_streamed, complete=end)
        if decision.action is Action.DONE and r is None:  # the shard died after the stream's last token
            ch.watch_loss(lost)
            result = Result(rid, finish_reason=decision.finish_reason, shard=shard)
            _as_asked(result, original)
            break
        if decision.action is Action.DONE:
            result = r
            break
        if decision.action is Action.FAIL:
            if lost is not None:  # the stream ends here, but new requests avoid the shard while it restarts
                ch.watch_loss(lost)
            result = failed_result(p, decision.error)
            break
        await ch.apply(p, decision, r, lost)
        if lost is not None and now_streamed:  # go on from the last token (the caller's request is untouched)
            p.request = continuation(original, streamed)
            p.wire_bytes = request_wire_size(len(p.request.prompt_token_ids), len(p.request.sampling.stop_token_ids))
            set_estimates(p, d.model_revision, d.max_model_len)
            resumed += 1
            d.counters.stream_resumes += 1
    result.id = rid
    result.output_token_ids = list(streamed) if streamed else list(result.output_token_ids)
    if resumed:
        _as_asked(result, original)
    result.timings.update(split, attempts=p.attempts + 1, resumed=resumed)
    return result


def _as_asked(result: Result, original: Request) -> None:
    """A resumed stream's result (or one its streamed tokens ended) reports the prompt its caller sent, not the
    continuation's."""
    result.prompt_tokens = len(original.prompt_token_ids)
    result.cached_tokens = min(result.cached_tokens, result.prompt_tokens)
    result.prompt_digest = prompt_digest(original.prompt_token_ids)


def _tell(d: Dispatcher, untold: list[Pending], shard: int) -> None:
    if untold:  # else the stream ended first, and stream_request told the router before its completion
        d.routing.tell(untold.pop(), shard)


async def _one_stream(d: Dispatcher, ch: ShardChannel, payload: bytes, streamed: list[int],
                      push: Callable[[StreamChunk], None], split: dict[str, float], untold: list[Pending]) -> Result:
    """One attempt on one shard, over the client's connection to its stream server: push its token chunks, return
    its result. Cancelled: abort it on the shard. A lost shard (or connection) raises SHARD_LOST; the attempt does
    not outlive it there (a closed connection ends its streams on the shard), and the next attempt has its own id.
    split gets sent_at and first_chunk_at_client (time.time(): the hop's ends, beside the actor's own).
    untold: the request when the router is still to be told of its placement (done TELL_AFTER_S after the first
    chunk, or by stream_request when the stream ends first)."""
    split["sent_at"] = time.time()
    items = ch.stream_items(payload)
    telling = None
    async with aclosing(items):
        async for item in items:
            if isinstance(item, list):
                if "first_chunk_at_client" not in split:
                    split["first_chunk_at_client"] = time.time()
                streamed.extend(item)
                push(StreamChunk(item))
                if untold and not telling:
                    telling = asyncio.get_running_loop().call_later(TELL_AFTER_S, _tell, d, untold, ch.shard)
                continue
            (r,) = d.codec.decode(item)
            return r
    raise SHARD_LOST[0]()  # the generator ended without its result: the actor died under it

