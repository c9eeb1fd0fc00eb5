"""What a client knows of its shards' lives: their incarnations, the shards it routes around and why, and the
waits for a restarted shard. Lives on the client's event loop.

A shard that died is waited for (up to restart_timeout_s; every batch that saw it die shares the wait); while
it restarts, new requests go to the other shards when there are any (`restarting`). A
shard that answers as a new incarnation has a cold engine: the router drops its prefixes. A shard that is
draining, or that did not come back, is avoided: routing leaves it out, and a watcher probes its health
until it serves again. A shard whose node is gone cannot come back where it was (Ray says so with
ActorUnschedulableError): it is not waited for; the router drops its prefixes, its requests go to the other
shards, and the watcher looks the shard up by name until the service has placed a replacement.

ShardLoss: what the client does when a shard dies under its requests: the shard's restart is watched
(ShardWatch.restart, one wait shared by everyone who saw it die; routing leaves a restarting shard out while another
can serve) and the requests held for its credit go to the other shards; a shard that does not come back, or cannot
(its node is gone), is routed around. A batch (or stream) that was in flight there is routed again at once when
another shard can serve it, else after the restart, or failed, as the retry policy (retry.py) says. Runs on the
client's loop."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnschedulableError, RayActorError, RayError

from flame_llm.protocol.errors import ErrorCode, ErrorInfo
from flame_llm.protocol.types import ShardHealth
from flame_llm.serving.batcher import ClientCounters, Pending, failed_result
from flame_llm.serving.credit import Credit
from flame_llm.serving.ray_attach import SHARD_PREFIX
from flame_llm.serving.retry import Action, decide
from flame_llm.serving.stream_conn import StreamConns
from router.replica_client import RouterReplicas

WATCH_INTERVAL_S = 1.0  # between health probes of an avoided shard
PROBE_TIMEOUT_S = 10.0


def shard_by_name(namespace: str) -> Callable[[int], ray.actor.ActorHandle | None]:
    """shard -> its actor by name in `namespace` now (a replacement placed after its node was lost has a new
    handle), or None."""
    def lookup(shard: int) -> ray.actor.ActorHandle | None:
        try:
            return ray.get_actor(f"{SHARD_PREFIX}{shard}", namespace=namespace)
        except ValueError:
            return None

    return lookup


class ShardWatch:
    def __init__(self, actors: dict[int, ray.actor.ActorHandle], router: RouterReplicas,
                 health: list[ShardHealth], restart_timeout_s: float, counters: ClientCounters,
                 lookup: Callable[[int], ray.actor.ActorHandle | None] | None = None,
                 on_drop: Callable[[int], None] | None = None,
                 on_conn_lost: Callable[[int, BaseException], None] | None = None) -> None:
        self.actors, self.restart_timeout_s, self.counters = actors, restart_timeout_s, counters
        self.router = RouterReplicas.of(router)
        self.lookup = lookup  # shard -> its actor by name now (a replacement's handle), or None
        self.on_drop = on_drop  # shard -> None: its prefixes were dropped at the router (restarted or lost)
        self.restarting: set[int] = set()  # shards that died and are waited for: new requests go elsewhere
        self.incarnation = {s: h.incarnation for s, h in zip(actors, health, strict=True)}
        self.avoid: dict[int, ErrorInfo] = {}  # shard -> why requests are routed around it
        self._recovering: dict[int, asyncio.Future] = {}
        self._watchers: dict[int, asyncio.Task] = {}
        self._unschedulable: set[int] = set()
        # the socket stream transport's connections, made on first use; on_conn_lost: one its shard's side ended
        self.streams = StreamConns(actors, counters, on_conn_lost)
        self.liveness = False  # keep a connection to every shard (keep_connected): its end says the shard died
        self._connects: set[asyncio.Task] = set()

    def keep_connected(self, shards: list[int] | None = None) -> None:
        """Open each shard's stream connection now and after each restart (the socket transport), whether or not
        a stream uses it: when a shard's process dies its connection ends, and this client routes around it at
        once, batches included, instead of learning it from a request that fails or waits there. On the loop."""
        self.liveness = True
        for shard in self.actors if shards is None else shards:
            task = asyncio.get_running_loop().create_task(self._connect_quietly(shard))
            self._connects.add(task)
            task.add_done_callback(self._connects.discard)

    async def _connect_quietly(self, shard: int) -> None:
        try:
            await self.streams.get(shard)
        except (RayError, OSError, asyncio.TimeoutError):  # dead now: its requests find out, as before
            pass

    def avoid_shard(self, shard: int, why: ErrorInfo) -> None:
        """Route around the shard until its health says it serves again."""
        self.avoid[shard] = why
        if shard not in self._watchers:
            self._watchers[shard] = asyncio.get_running_loop().create_task(self._watch(shard))

    def lose_shard(self, shard: int, e: BaseException) -> None:
        """The shard did not come back (or cannot): route around it, drop its prefixes, watch for a replacement."""
        prior = self.avoid.get(shard)
        # once per loss: a shard avoided only because it was draining (as a node going down does) is lost now
        if prior is None or prior.code is not ErrorCode.SHARD_UNAVAILABLE:
            self.router.drop_shard(shard)
            if self.on_drop is not None:
                self.on_drop(shard)
        why = "cannot be placed again (its node is gone)" if isinstance(e, ActorUnschedulableError) else \
            f"did not come back within {self.restart_timeout_s}s"
        self.avoid_shard(shard, ErrorInfo(ErrorCode.SHARD_UNAVAILABLE, f"shard {shard} died and {why}: "
                                                                       f"{type(e).__name__}: {e}"))

    def restart(self, shard: int, e: BaseException | None = None) -> asyncio.Future | None:
        """The shard's restart wait, begun now (one per restart, shared; await it shielded): True once the actor
        answers again, False when it did not within restart_timeout_s. The shard is `restarting` from this call
        on. None when it cannot come back (`e`, the error it failed with, says its node is gone)."""
        if isinstance(e, ActorUnschedulableError):
            return None
        fut = self._recovering.get(shard)
        if fut is None:
            fut = self._recovering[shard] = asyncio.ensure_future(self._restart_once(shard))
            self.restarting.add(shard)

            def over(_) -> None:
                self._recovering.pop(shard, None)
                self.restarting.discard(shard)

            fut.add_done_callback(over)
        return fut

    async def stop(self) -> None:
        """The client goes: its watchers and restart waits end."""
        tasks = list(self._watchers.values()) + list(self._recovering.values()) + list(self._connects)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.streams.close()

    async def _health(self, shard: int) -> ShardHealth | None:
        """The shard's health, or None when it does not answer; a new incarnation's prefixes are dropped."""
        try:
            h = await asyncio.wait_for(self.actors[shard].health.remote(), timeout=PROBE_TIMEOUT_S)
        except (RayError, asyncio.TimeoutError) as e:
            if isinstance(e, ActorUnschedulableError):
                self._unschedulable.add(shard)
            if self.lookup is not None:  # next time ask the actor of that name now: a replacement, if placed
                handle = await asyncio.to_thread(self.lookup, shard)
                if handle is not None:
                    self.actors[shard] = handle
            return None
        if h.incarnation != self.incarnation[shard]:
            self.incarnation[shard] = h.incarnation
            self.counters.restarts_seen += 1
            # the dead incarnation's connection goes; one a stream already made to this one stays (closing it
            # ended the streams on it and sent them again: session 7's H200 shard-kill run)
            self.streams.drop(shard, "the shard restarted", keep=h.incarnation)
            if self.liveness:
                self.keep_connected([shard])
            if self.on_drop is not None:
                self.on_drop(shard)
            # fire and forget, as lose_shard: awaited, a restarting router's RayActorError ended the watcher and
            # left the shard avoided for good
            self.router.drop_shard(shard)
        return h

    async def _restart_once(self, shard: int) -> bool:
        deadline = time.monotonic() + self.restart_timeout_s
        while time.monotonic() < deadline:
            if await self._health(shard) is not None:
                return True
            if shard in self._unschedulable:  # its node is gone: Ray will not restart it
                self._unschedulable.discard(shard)
                return False
            await asyncio.sleep(0.2)
        return False

    async def _watch(self, shard: int) -> None:
        try:
            while True:
                await asyncio.sleep(WATCH_INTERVAL_S)
                h = await self._health(shard)
                if h is not None and not h.draining:
                    self.avoid.pop(shard, None)
                    return
        finally:
            self._watchers.pop(shard, None)


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
