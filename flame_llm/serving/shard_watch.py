"""What a client knows of its shards' lives: their incarnations, the shards it routes around and why, and the
waits for a restarted shard. Lives on the client's event loop.

A shard that died is waited for (up to restart_timeout_s; every batch that saw it die shares the wait); while it
restarts, new requests go to the other shards when there are any (`restarting`). A shard that answers as a new
incarnation has a cold engine: the router drops its prefixes. A shard that is draining, or that did not come back,
is avoided: routing leaves it out, and a watcher probes its health until it serves again. A shard whose node is gone
cannot come back where it was (Ray says so with ActorUnschedulableError): it is not waited for; the router drops its
prefixes, its requests go to the other shards, and the watcher looks the shard up by name until the service has
placed a replacement. What the client does when a shard dies under its requests is its ShardChannel's (channel.py);
its owner (the Dispatcher) hears of a shard that restarted or was lost (`shard_changed`): its prefixes and its old
connection go."""
from __future__ import annotations

import asyncio
import time
from typing import Protocol

import ray
from ray.exceptions import ActorUnschedulableError, RayError

from flame_llm.protocol.errors import ErrorCode, ErrorInfo
from flame_llm.protocol.types import ShardHealth
from flame_llm.serving.pending import ClientCounters
from flame_llm.serving.ray_attach import SHARD_PREFIX
from router.replica_client import RouterReplicas

WATCH_INTERVAL_S = 1.0  # between health probes of an avoided shard
PROBE_TIMEOUT_S = 10.0


class ShardsOwner(Protocol):
    def shard_changed(self, shard: int, incarnation: str | None = None) -> None:
        """The shard restarted (`incarnation`: the one that answers now) or was lost (None) (Dispatcher's)."""


class ShardWatch:
    def __init__(self, actors: dict[int, ray.actor.ActorHandle], router: RouterReplicas,
                 health: list[ShardHealth], restart_timeout_s: float, counters: ClientCounters,
                 namespace: str | None = None, owner: ShardsOwner | None = None) -> None:
        self.actors, self.restart_timeout_s, self.counters = actors, restart_timeout_s, counters
        self.router = RouterReplicas.of(router)
        self.namespace = namespace  # where a lost shard's replacement is looked up by name (None: not looked up)
        self.owner = owner  # told of a shard that restarted or was lost (Dispatcher.shard_changed)
        self.restarting: set[int] = set()  # shards that died and are waited for: new requests go elsewhere
        self.incarnation = {s: h.incarnation for s, h in zip(actors, health, strict=True)}
        self.avoid: dict[int, ErrorInfo] = {}  # shard -> why requests are routed around it
        self._recovering: dict[int, asyncio.Future] = {}
        self._watchers: dict[int, asyncio.Task] = {}
        self._unschedulable: set[int] = set()

    def others_serve(self, shard: int) -> bool:
        """Whether a shard other than `shard` is neither avoided nor restarting."""
        return any(s != shard and s not in self.avoid and s not in self.restarting for s in self.actors)

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
            if self.owner is not None:
                self.owner.shard_changed(shard)
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
        tasks = list(self._watchers.values()) + list(self._recovering.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _health(self, shard: int) -> ShardHealth | None:
        """The shard's health, or None when it does not answer; a new incarnation's prefixes are dropped."""
        try:
            h = await asyncio.wait_for(self.actors[shard].health.remote(), timeout=PROBE_TIMEOUT_S)
        except (RayError, asyncio.TimeoutError) as e:
            if isinstance(e, ActorUnschedulableError):
                self._unschedulable.add(shard)
            if self.namespace is not None:  # next time ask the actor of that name now: a replacement, if placed
                try:
                    self.actors[shard] = await asyncio.to_thread(ray.get_actor, f"{SHARD_PREFIX}{shard}",
                                                                 namespace=self.namespace)
                except ValueError:  # not placed yet
                    pass
            return None
        if h.incarnation != self.incarnation[shard]:
            self.incarnation[shard] = h.incarnation
            self.counters.restarts_seen += 1
            if self.owner is not None:  # its prefixes and the dead incarnation's connection go
                self.owner.shard_changed(shard, h.incarnation)
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
