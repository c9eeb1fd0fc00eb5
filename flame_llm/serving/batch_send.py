"""One formed batch's trip to its shard: encoded (batcher.ClientCodec), submitted to the shard's engine actor, and its
results read as they finish (the actor's `submit_streaming`). The shard's flow-control credit comes back per
result; the answered requests go to `settle` (their callers, or the retry policy), those of a shard that died to
`lost` (shard_watch.ShardLoss). Cancelled
(the client closes) or failed (a bug, an unreadable reply), the unanswered requests leave the router's count and
are aborted on the shard, and a failure is every waiting caller's result."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from flame_llm.protocol.errors import ErrorCode, ErrorInfo
from flame_llm.protocol.types import Result
from flame_llm.serving.batcher import ClientCodec, ClientCounters, Pending, attempt_id, failed_result
from flame_llm.serving.credit import Credit
from flame_llm.serving.shard_watch import SHARD_LOST

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BatchSender:
    """Sends a client's batches, with the dispatcher's (dispatch.py) parts it needs."""
    actors: dict[int, ray.actor.ActorHandle]  # shard -> its engine actor (ShardWatch puts a replacement's here)
    caller: str  # this client's Ray job (the shards abort its requests when it dies) and id (its turn there)
    client_id: str
    counters: ClientCounters
    codec: ClientCodec
    credit: Credit
    # (shard, [(request, its result)], (encoding began, the payload left)): each to its caller, or retried
    settle: Callable[[int, list[tuple[Pending, Result]], tuple[float, float]], Awaitable[None]]
    lost: Callable[[int, list[Pending], BaseException], Awaitable[None]]  # the shard died with these in flight
    forget: Callable[[int, list[Pending]], None]  # (shard, requests) that shard will not answer: the router is told
    abort_on: Callable[[int, list[str]], None]  # (shard, ids the attempts went under: batcher.attempt_id): stop them

    async def send(self, shard: int, batch: list[Pending], credit: int) -> None:
        """Send the batch; `credit`: the units of the shard's credit it holds, given back as its results land
        (all of them when it ends)."""
        held = [credit]
        waiting = {attempt_id(p): p for p in batch}  # sent and not yet answered (nor handed on: lost shard)
        try:
            await self._send(shard, batch, held, waiting)
        except asyncio.CancelledError:  # the client closes: the shard need not serve them, the router not count them
            left = list(waiting.values())
            self.forget(shard, left)
            if left:
                self.abort_on(shard, [attempt_id(p) for p in left])
            raise
        except Exception as e:  # a bug or an unreadable result must not leave callers waiting forever
            log.exception("shard %d: batch of %d failed", shard, len(batch))
            left = list(waiting.values())  # abandoned ones too: the router counts them until told
            for p in left:
                if not p.future.done():
                    p.future.set_result(failed_result(p, ErrorInfo(ErrorCode.CLIENT_ERROR,
                                                                   f"{type(e).__name__}: {e}")))
            self.forget(shard, left)
            if left:  # the shard may still be serving them
                self.abort_on(shard, [attempt_id(p) for p in left])
        finally:
            if held[0]:
                self.credit.give(shard, held[0])

    async def _send(self, shard: int, batch: list[Pending], held: list[int], waiting: dict[str, Pending]) -> None:
        self.counters.batches += 1
        t0 = time.perf_counter()
        payload = self.codec.encode(batch)
        t1 = time.perf_counter()
        sent = (t0, t1)
        gen = self.actors[shard].submit_streaming.remote(payload, self.caller, self.client_id)
        try:
            async for ref in gen:
                results = self.codec.decode(await ref)
                if len(results) == 1 and results[0].id is None:  # the actor could not read the batch
                    pairs = [(p, _for(p, results[0])) for p in waiting.values()]
                    waiting.clear()
                else:
                    pairs = [(waiting.pop(r.id), r) for r in results]
                n = min(len(pairs), held[0])  # credit comes back per result, not per batch
                held[0] -= n
                if n:
                    self.credit.give(shard, n)
                await self.settle(shard, pairs, sent)
        except SHARD_LOST as e:
            lost = list(waiting.values())
            waiting.clear()
            await self._lost(shard, lost, e)
            return
        if waiting:  # the generator ended without their results: the actor died under it
            lost = list(waiting.values())
            waiting.clear()
            await self.lost(shard, lost, RayActorError())

    async def _lost(self, shard: int, ps: list[Pending], e: BaseException) -> None:
        """The shard's call failed with these unanswered: they go to `lost` (sent again, under new attempt ids).
        Unavailable is not dead (a restart under way, or a connection that failed): it may still serve them."""
        if isinstance(e, ActorUnavailableError) and ps:
            self.abort_on(shard, [attempt_id(p) for p in ps])
        await self.lost(shard, ps, e)


def _for(p: Pending, r: Result) -> Result:
    """A batch-wide result (id None) as one request's."""
    return dataclasses.replace(r, id=attempt_id(p), timings=dict(r.timings))
