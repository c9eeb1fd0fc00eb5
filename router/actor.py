"""The named router actor: a thin Ray shell around RouterPolicy.

One `route` call per formed batch; completions come back batched (the client may fire them without
waiting). The actor runs one call at a time, so the policy needs no locks. It takes no CPU from the
scheduler (num_cpus=0): routing a batch is sub-millisecond work and must never wait for a free CPU.
Restarted by Ray if it dies; a restarted router starts with an empty map (every prefix is unseen). It lives
on the cluster's head node (Ray's `node:__internal_head__` resource): losing a worker node never costs the
map, and losing the head node ends the cluster anyway. With router.replicas N > 1 the service runs N of them
(start_routers; replica r named replica_name(ROUTER_NAME, r)), each routing its share of the prefixes
(router/replica_client.py) and each pulling every shard's cache events.

With policy 'events' and the shards' actor names given, a thread pulls the shards' cache events (router/event_feed.py)
every event_poll_ms; calls and the feed take one lock. A restarted router resyncs from every shard's snapshot.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import ray

from flame_llm.protocol.routing_key import Completion, RouteItem
from router.event_feed import EventFeed
from router.policy import RouterConfig, RouterPolicy
from router.replicas import ROUTER_NAME, replica_name  # noqa: F401 - the router's names, imported from here too

log = logging.getLogger(__name__)
HEAD_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node


@ray.remote(num_cpus=0, max_restarts=-1)
class Router:

    def __init__(self, num_shards: int, config: RouterConfig, shard_names: Sequence[str] = (),
                 namespace: str = "", replica: int = 0) -> None:
        # replica r of config.replicas: its home shards come first among equally loaded ones (router.load_view)
        self._policy = RouterPolicy(num_shards, config, home=(replica, config.replicas))
        self._lock = threading.Lock()
        self._feed = None
        if config.policy == "events" and shard_names:
            self._feed = EventFeed(self._policy, self._lock, list(shard_names), namespace,
                                   config.event_poll_ms / 1000.0)
            self._feed.start()

    def route(self, items: list[RouteItem], avoid: Sequence[int] = ()) -> list[int]:
        """Shard per RouteItem (prefix chain, est_prefill_work, est_decode_tokens), in order, none in avoid."""
        with self._lock:
            return self._policy.route_batch(items, avoid)

    def place(self, items: list[RouteItem], shards: list[int]) -> None:
        """Requests the client placed itself, items[i] on shards[i] (RouterPolicy.place_batch)."""
        with self._lock:
            self._policy.place_batch(items, shards)

    def complete(self, completions: list[Completion]) -> None:
        """One Completion per finished request."""
        with self._lock:
            self._policy.complete_many(completions)

    def drop_shard(self, shard: int) -> None:
        with self._lock:
            self._policy.drop_shard(shard)

    def poll_events(self) -> dict:
        """One event-feed round now (tests; the feed's thread polls on its own): its counters."""
        if self._feed is None:
            raise ValueError("this router has no event feed (policy 'events' with the shards' names)")
        self._feed.poll()
        return dict(self._feed.counters)

    def config(self) -> tuple[int, RouterConfig]:
        return self._policy.num_shards, self._policy.config

    def stats(self) -> dict:
        with self._lock:
            st = self._policy.stats()
        feed = {"event_feed": dict(self._feed.counters)} if self._feed is not None else {}
        return {**st, **feed, "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


def start_routers(num_shards: int, config: RouterConfig, *, namespace: str, lifetime: str | None = None,
                  shard_names: Sequence[str] = ()) -> list[ray.actor.ActorHandle]:
    """The config.replicas router replicas (start_router each), replica 0 first."""
    return [start_router(num_shards, config, name=replica_name(ROUTER_NAME, r), namespace=namespace,
                         lifetime=lifetime, shard_names=shard_names, replica=r) for r in range(config.replicas)]


def start_router(num_shards: int, config: RouterConfig | None = None, *, name: str = ROUTER_NAME, namespace: str,
                 lifetime: str | None = None, shard_names: Sequence[str] = (),
                 replica: int = 0) -> ray.actor.ActorHandle:
    """The named router, created or, when one of that name already lives in the namespace, joined.
    Joining a router configured differently raises ValueError naming the differing fields.
    lifetime="detached" keeps it alive after the creating driver exits. shard_names: the engine actors' names in the
    namespace, shard by shard (policy 'events' pulls their cache events). replica: this router's index among
    config.replicas (its home shards under a load view)."""
    config = RouterConfig() if config is None else config
    if not isinstance(config, RouterConfig):
        raise ValueError(f"config must be a RouterConfig; got {config!r:.80}")
    RouterPolicy(num_shards, config)  # bad values raise here, in the caller, not in a dead actor
    if lifetime not in (None, "detached", "non_detached"):
        raise ValueError(f"lifetime must be None, 'detached' or 'non_detached'; got {lifetime!r}")
    handle = Router.options(name=name, namespace=namespace, get_if_exists=True, lifetime=lifetime,
                            resources={HEAD_RESOURCE: 0.001}).remote(num_shards, config, list(shard_names), namespace,
                                                                     replica)
    running_shards, running = ray.get(handle.config.remote())
    diff = {"num_shards": (running_shards, num_shards)} if running_shards != num_shards else {}
    diff.update({f: (getattr(running, f), getattr(config, f)) for f in RouterConfig.__dataclass_fields__
                 if getattr(running, f) != getattr(config, f)})
    if diff:
        raise ValueError(f"router {name!r} in namespace {namespace!r} already runs with a different "
                         "configuration: " + ", ".join(f"{k}={a!r} (asked {b!r})" for k, (a, b) in diff.items()))
    return handle


def revive_routers(handles: list, num_shards: int, config: RouterConfig, *, namespace: str,
                   lifetime: str | None = None, shard_names: Sequence[str] = (), timeout_s: float = 30.0,
                   stopped: Callable[[], bool] = lambda: False) -> list[int]:
    """Start again each router replica that is dead for good (ActorDiedError: killed without restart, or its
    restarts spent), under its name, in place in `handles`; the replicas revived. A replica Ray is restarting is
    left to Ray; so is every dead one once `stopped()` is true, asked after its death was seen (the service was
    stopped on purpose and marked so before the kill). The clients find a revived replica by its name
    (RouterReplicas probes) and give it its share back."""
    refs = {r: h.config.remote() for r, h in enumerate(handles)}
    revived = []
    for r, ref in refs.items():
        try:
            ray.get(ref, timeout=timeout_s)
            continue
        except ray.exceptions.ActorDiedError:
            pass
        except ray.exceptions.RayError:  # restarting or slow: Ray brings it back, or the next look decides
            continue
        if stopped():
            return revived
        name = replica_name(ROUTER_NAME, r)
        deadline = time.monotonic() + timeout_s
        while True:  # the dead actor's name is released shortly after its death
            try:
                handles[r] = start_router(num_shards, config, name=name, namespace=namespace, lifetime=lifetime,
                                          shard_names=shard_names, replica=r)
                break
            except (ValueError, ray.exceptions.RayActorError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        log.warning("router replica %s was dead; started again", name)
        revived.append(r)
    return revived
