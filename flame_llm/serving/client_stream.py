"""One streamed request of the client (Client.stream, Client.stream_chunks): routed by the router's `route` call
like a batch, encoded by the wire codec as a batch of one, served by the shard's `stream` method (a Ray
streaming generator: token chunks as the engine samples them, then the result payload).

Until its first token arrives a stream is retried as a batch request is (an overloaded shard after its hint,
a draining or lost shard's request on another shard); after that a failure ends it with the error. Cancelling
the task that runs it (the caller stopped reading) aborts it on its shard."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from ray.exceptions import ActorUnschedulableError, RayActorError

from flame_llm.protocol.routing_key import Completion, RouteItem
from flame_llm.protocol.types import ErrorCode, ErrorInfo, Result
from flame_llm.protocol.wire import decode_results, encode_requests
from flame_llm.sampling_params import SamplingParams
from flame_llm.serving.dispatch import failed_result


@dataclass(slots=True)
class StreamChunk:
    """Token ids the shard sent at once; the last chunk of a stream carries its result dict."""
    token_ids: list[int]
    result: dict | None = None


class StreamError(RuntimeError):
    """A streamed request failed; `result` is its result dict (error code, message, tokens it had)."""

    def __init__(self, result: dict) -> None:
        err = result["error"]
        super().__init__(f"{err['code']}: {err['message']}")
        self.result = result


async def stream_request(client, prompt, sp: SamplingParams, push: Callable[[StreamChunk], None]) -> None:
    """Serve one streamed request of `client` (a flame_llm.serving.client.Client) on its loop, handing each chunk
    to `push` (the last with the result)."""
    t0 = time.perf_counter()
    d = client.dispatch
    p = client._prepare(prompt, sp, asyncio.get_running_loop())
    client.counters["streams"] += 1
    if p.future.done():  # invalid: never sent
        push(StreamChunk([], p.future.result().to_dict()))
        return
    rid, streamed = p.request.id, []
    result: Result | None = None
    while result is None:
        avoid = sorted(d.shards.avoid) if len(d.shards.avoid) < len(client.actors) else []
        try:
            (shard,) = await d.route_call([RouteItem(p.chain, p.est_work, p.est_decode)], avoid)
        except Exception as e:  # the router is down
            result = failed_result(p, ErrorInfo(ErrorCode.ROUTER_ERROR, f"{type(e).__name__}: {e}"))
            break
        p.shard = shard
        why = d.shards.avoid.get(shard)
        if why is not None:  # no shard is left to serve it
            d.forget(shard, [p])
            result = failed_result(p, why)
            break
        payload = encode_requests([p.request], client.model_revision, d.zstd_level)
        r, lost = None, None
        try:
            took = await d.take_credit(shard)  # within the shard's flow-control credit, as batches are
            try:
                r = await _one_stream(client, shard, payload, rid, streamed, push)
            finally:
                if took:
                    d.give_credit(shard)
        except (RayActorError, ActorUnschedulableError) as e:
            lost = e
        finally:
            if r is None:  # lost, cancelled (the caller left, a stop string) or failed: not answered there
                d.forget(shard, [p])
        if lost is not None:
            if streamed or p.attempts >= client.max_retries:
                result = failed_result(p, ErrorInfo(ErrorCode.SHARD_DIED, f"shard {shard} died while streaming "
                                                    f"this request: {type(lost).__name__}: {lost}"))
                break
            if not await d.shards.await_restart(shard, lost):
                d.shards.lose_shard(shard, lost)
            p.attempts += 1
            client.counters["retries"] += 1
            continue
        err = r.error
        ok = err is None
        client.router.complete.remote([Completion(shard, p.est_work, p.est_decode, r.prompt_tokens if ok else 0,
                                                  r.cached_tokens if ok else 0)])
        if err is not None and err.code.retryable and not streamed and p.attempts < client.max_retries:
            p.attempts += 1
            client.counters["retries"] += 1
            if err.code is ErrorCode.OVERLOADED:
                await asyncio.sleep(err.retry_after_s or 0.0)
            else:
                d.shards.avoid_shard(shard, err)
            continue
        result = r
    result.id = rid
    result.output_token_ids = list(streamed) if streamed else list(result.output_token_ids)
    result.timings.update(client_s=time.perf_counter() - t0, attempts=p.attempts + 1)
    push(StreamChunk([], result.to_dict()))


async def _one_stream(client, shard: int, payload: bytes, rid: str, streamed: list[int],
                      push: Callable[[StreamChunk], None]) -> Result:
    """One attempt on one shard: push its token chunks, return its result. Cancelled: abort it on the shard."""
    gen = client.actors[shard].stream.remote(payload, client.dispatch.caller)
    try:
        async for ref in gen:
            item = await ref
            if isinstance(item, list):
                streamed.extend(item)
                push(StreamChunk(item))
                continue
            (r,) = decode_results(item)
            return r
    except asyncio.CancelledError:
        client.dispatch.abort_on(shard, [rid])
        raise
    raise RayActorError()  # the generator ended without its result: the actor died under it
