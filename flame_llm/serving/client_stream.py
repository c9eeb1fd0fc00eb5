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

import time
from collections.abc import Callable
from dataclasses import dataclass

from flame_llm.protocol.types import Request, Result, prompt_digest
from flame_llm.protocol.wire import request_wire_size
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


async def stream_request(d: Dispatcher, p: Pending, push: Callable[[StreamChunk], None]) -> Result:
    """Serve one prepared request `p` (not failed at entry) through dispatcher `d` on its loop, handing each token
    chunk to `push`; its Result (output_token_ids: what was streamed; prompt_tokens: the caller's prompt;
    timings["resumed"]: how many times it went on from its last token after its shard died, retry.py)."""
    rid, original, streamed = p.request.id, p.request, []
    resumed = 0
    split: dict[str, float] = {}  # the last attempt's route_s, credit_wait_s, sent_at, first_chunk_at_client
    while True:
        t0 = time.perf_counter()
        shard, untold = await d.place_stream(p)
        split["route_s"] = time.perf_counter() - t0
        if not isinstance(shard, int):  # the router is down, or no shard is left to serve it
            result = p.future.result()
            break
        ch, before = d.channels[shard], len(streamed)
        split.pop("first_chunk_at_client", None)  # this attempt's
        r, lost = await ch.stream(p, streamed, lambda toks: push(StreamChunk(toks)), split, untold)
        now_streamed = len(streamed) > before  # earlier attempts' tokens are in this attempt's prompt
        end = (stream_end(original, streamed, d.limits.max_model_len, d.eos_token_ids)
               if lost is not None and now_streamed else None)
        decision = decide(p, d.config.max_retries, r, lost, shard, streamed=now_streamed, complete=end)
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
            set_estimates(p, d.model_revision, d.limits.max_model_len)
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
