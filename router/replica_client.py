"""The client's (and the front door's) side of router scale-out (issue 42): RouterReplicas holds the N router
actors' handles (`router.replicas`; replica r is the named actor replica_name(ROUTER_NAME, r)) and routes each request
to the replica that owns its first routing block on the ring (router/replicas.py).

A replica that dies (RayActorError: ActorDiedError, ActorUnavailableError) leaves the client's ring at once: the
requests of the call it lost go, in the same call, to the next live replica on the ring, which holds every shard's
holdings (each replica pulls every shard's cache events, router/event_feed.py) and so loses only the dead one's
recent placements. Every request remembers the (replica, epoch) that charged its work; its completion or forget goes
to that replica, and to none once the replica died (its counts died with it). A dead replica is probed (found again
by name: Ray restarted it, or the service's supervisor made a new one, Service.replace_lost_routers) every
PROBE_EVERY_S and rejoins the ring when it answers. The last live replica is never left: its error goes to the
caller, whose routing waits for a restart (flame_llm/serving/routing.py), as with one router.

With one replica every call goes to it as before: the same actor name and the same calls."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import ray
from ray.exceptions import RayActorError

from flame_llm.protocol.routing_key import Completion, RouteItem
from router.replicas import ROUTER_NAME, ReplicaRing, replica_name

log = logging.getLogger(__name__)
PROBE_EVERY_S = 0.5  # a dead replica is looked for again this often (on the next call after it)
PROBE_TIMEOUT_S = 5.0


class Charge(NamedTuple):
    """Who charged a request's work: its completion goes to that replica while the epoch is current."""

    replica: int
    epoch: int


NO_CHARGE = Charge(0, 0)


class RouterReplicas:
    def __init__(self, handles: Sequence, namespace: str = "", name: str = ROUTER_NAME) -> None:
        assert handles, "a service has at least one router"
        self.handles, self.namespace, self.name = list(handles), namespace, name
        self.ring = ReplicaRing(len(self.handles))
        self.epoch = [0] * len(self.handles)  # bumped when the replica is seen dead
        self._next_probe: dict[int, float] = {}  # dead replica -> when it is looked for next
        self._probes: set[asyncio.Task] = set()
        self.counters = {"failovers": 0, "lost": 0, "revived": 0}

    @classmethod
    def of(cls, router, namespace: str = "") -> RouterReplicas:
        """router: a RouterReplicas (kept), a list of replica handles, or one router handle."""
        if isinstance(router, RouterReplicas):
            return router
        return cls(list(router) if isinstance(router, (list, tuple)) else [router], namespace)

    @property
    def num_replicas(self) -> int:
        return len(self.handles)

    def owner(self, chain: Sequence[int]) -> int:
        return 0 if len(self.handles) == 1 else self.ring.owner_of(chain)

    def charge(self, replica: int) -> Charge:
        return Charge(replica, self.epoch[replica])

    async def route(self, items: list[RouteItem], avoid: Sequence[int] = ()) -> tuple[list[int], list[Charge]]:
        """The shard of every item and who charged it. A replica lost mid-call: its items go to the next owner."""
        if len(self.handles) == 1:  # one router (the default): one call, as before replicas
            return await self.handles[0].route.remote(items, avoid), [self.charge(0)] * len(items)
        self._probe_dead()
        shards: list[int] = [-1] * len(items)
        charged: list[Charge] = [NO_CHARGE] * len(items)
        todo = list(range(len(items)))
        while todo:
            groups: dict[int, list[int]] = {}
            for i in todo:
                groups.setdefault(self.owner(items[i].chain), []).append(i)
            calls = {r: self.handles[r].route.remote([items[i] for i in idx], avoid) for r, idx in groups.items()}
            todo = []
            for r, idx in groups.items():
                try:
                    got = await calls[r]
                except RayActorError as e:
                    self.lose(r, e)  # raises when r was the last live replica
                    self.counters["failovers"] += 1
                    todo += idx
                    continue
                assert len(got) == len(idx), "a router answers every item"
                for i, s in zip(idx, got, strict=True):
                    shards[i], charged[i] = s, self.charge(r)
        return shards, charged

    def place(self, items: list[RouteItem], shards: list[int]) -> list[Charge]:
        """Requests placed by the client (RouterPolicy.place_batch), each told to its owner; who charged each."""
        groups: dict[int, list[int]] = {}
        for i, it in enumerate(items):
            groups.setdefault(self.owner(it.chain), []).append(i)
        for r, idx in groups.items():
            self.handles[r].place.remote([items[i] for i in idx], [shards[i] for i in idx])
        return [self.charge(self.owner(it.chain)) for it in items]

    def complete(self, completions: list[Completion], charged: list[Charge]) -> None:
        """Each completion to the replica that charged its work, while that replica lives on (same epoch)."""
        if len(self.handles) == 1:
            self.handles[0].complete.remote(completions)
            return
        groups: dict[int, list[Completion]] = {}
        for c, (r, epoch) in zip(completions, charged, strict=True):
            if epoch == self.epoch[r] and r in self.ring.alive:
                groups.setdefault(r, []).append(c)
        for r, cs in groups.items():
            self.handles[r].complete.remote(cs)

    def drop_shard(self, shard: int) -> None:
        for r in sorted(self.ring.alive):
            self.handles[r].drop_shard.remote(shard)

    def lose(self, replica: int, e: BaseException) -> None:
        """The replica died: it leaves the ring (its share moves on) and its charges lapse. Re-raises e for the
        last live replica (the caller waits for its restart)."""
        if self.ring.alive == {replica} or len(self.handles) == 1:
            raise e
        if replica in self.ring.alive:
            log.warning(
                "router replica %d lost (%s: %s); its share moves to the next replicas", replica, type(e).__name__, e
            )
            self.ring.kill(replica)
            self.epoch[replica] += 1
            self.counters["lost"] += 1
            self._next_probe[replica] = time.monotonic() + PROBE_EVERY_S

    def _probe_dead(self) -> None:
        now = time.monotonic()
        for r, when in list(self._next_probe.items()):
            if when <= now:
                self._next_probe[r] = now + PROBE_TIMEOUT_S + PROBE_EVERY_S  # one probe at a time
                task = asyncio.get_running_loop().create_task(self._probe(r))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _probe(self, r: int) -> None:
        try:
            name = replica_name(self.name, r)
            handle = await asyncio.to_thread(ray.get_actor, name, namespace=self.namespace or None)
            await asyncio.wait_for(asyncio.wrap_future(handle.config.remote().future()), PROBE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - still gone: looked for again later
            log.debug("router replica %d not back yet: %s", r, e)
            self._next_probe[r] = time.monotonic() + PROBE_EVERY_S
            return
        self.handles[r] = handle
        self._next_probe.pop(r, None)
        self.ring.revive(r)
        self.counters["revived"] += 1
        log.warning("router replica %d is back; it takes its share again", r)

    def config(self):
        """(num_shards, RouterConfig) of the first replica that answers."""
        err: BaseException | None = None
        for h in self.handles:
            try:
                return ray.get(h.config.remote(), timeout=PROBE_TIMEOUT_S * 6)
            except Exception as e:  # noqa: BLE001 - another replica answers
                err = e
        raise err
