"""What the client does when a shard dies under its requests: the shard's restart is watched (ShardWatch.restart,
one wait shared by everyone who saw it die; routing leaves a restarting shard out while another can serve) and
the requests held for its credit go to the other shards; a shard that does not come back, or cannot (its node is
gone), is routed around. A batch (or stream) that was in flight there is routed again at once when another shard
can serve it, else after the restart, or failed, as the retry policy (retry.py)
says. Runs on the client's loop."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass

from ray.exceptions import ActorUnschedulableError, RayActorError

from flame_llm.serving.batcher import Pending, failed_result
from flame_llm.serving.credit import Credit
from flame_llm.serving.retry import Action, decide
from flame_llm.serving.shard_watch import ShardWatch

log = logging.getLogger(__name__)
SHARD_LOST = (RayActorError, ActorUnschedulableError)  # the shard's actor died, or cannot be placed again


@dataclass(slots=True)
class ShardLoss:
    """A client's handling of its shards' deaths, with the dispatcher's (dispatch.py) parts it needs."""
    shards: ShardWatch
    credit: Credit
    max_retries: int  # ClientConfig.max_retries
    forget: Callable[[int, list[Pending]], None]  # (shard, requests) that shard will not answer: the router is told
    route_again: Callable[[list[Pending]], Awaitable[None]]  # requests sent again: routed anew
    spawn: Callable[[Coroutine], None]  # run as a task the client awaits or cancels when it closes

    async def shard_lost(self, shard: int, batch: list[Pending], e: BaseException) -> None:
        """The shard died with the batch in flight: route the batch again, at once when another shard can serve
        it (the dead one's cache is gone either way), else once it is back; when it does not come back, or cannot
        (its node is gone), the other shards serve it. The dead shard will not answer them: their work leaves its
        count at the router now, once (whatever becomes of them: routed again, failed, or abandoned meanwhile); the
        restart's drop_shard, sent after this, only clears what other clients had there."""
        log.warning("shard %d failed with %d requests in flight (%s)", shard, len(batch), type(e).__name__)
        self.forget(shard, batch)
        restarted = await self.settle(shard, e)
        again = []
        for p in batch:
            if p.future.done():
                continue
            d = decide(p, self.max_retries, lost=e, shard=shard)
            if d.action is Action.RESTART:
                again.append(p)
            elif restarted is not False:  # a request that keeps killing shards stops here
                p.future.set_result(failed_result(p, d.error))
            else:
                p.future.set_result(failed_result(p, self.shards.avoid[shard]))
        await self.route_again(again)

    async def settle(self, shard: int, e: BaseException) -> bool | None:
        """After the shard died under requests that are sent again: None at once when another shard can serve
        them (reroute; the restart is watched meanwhile and routing leaves the shard out until it is back), else
        after_loss's answer once the restart is over."""
        if not isinstance(e, ActorUnschedulableError) and self._others_serve(shard):
            self.shards.restart(shard, e)  # restarting from now on: the requests routed again go elsewhere
            self.spawn(self.after_loss(shard, e))
            return None
        return await self.after_loss(shard, e)

    def _others_serve(self, shard: int) -> bool:
        w = self.shards
        return any(s != shard and s not in w.avoid and s not in w.restarting for s in w.actors)

    async def after_loss(self, shard: int, e: BaseException) -> bool:
        """The shard died: wait for its restart (True); when it does not come back (or cannot), route around it.
        Meanwhile the requests held for its credit go to the other shards (a restart takes an engine's startup)."""
        fut = self.shards.restart(shard, e)
        self.credit.release(shard)
        if fut is not None and await asyncio.shield(fut):
            return True
        self.shards.lose_shard(shard, e)
        return False

    def watch_loss(self, shard: int, e: BaseException) -> None:
        """The shard died under a request that is not sent again (a stream past its first token): its restart is
        still waited for, so new requests avoid it meanwhile."""
        self.spawn(self.after_loss(shard, e))
