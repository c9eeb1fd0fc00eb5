"""The named router actor: a thin Ray shell around RouterPolicy.

One `route` call per formed batch; completions come back batched (the client may fire them without
waiting). The actor runs one call at a time, so the policy needs no locks. It takes no CPU from the
scheduler (num_cpus=0): routing a batch is sub-millisecond work and must never wait for a free CPU.
Restarted by Ray if it dies; a restarted router starts with an empty map (every prefix is unseen).
"""
from __future__ import annotations

from collections.abc import Sequence

import ray

from flame_llm.protocol.routing_key import DECODE_TOKEN_COST, Completion, RouteItem
from router.policy import RouterPolicy

ROUTER_NAME = "flame-router"


@ray.remote(num_cpus=0, max_restarts=-1)
class Router:

    def __init__(self, num_shards: int, policy: str = "cumulative", spill_factor: float = 1.25,
                 max_entries: int = 100_000, decode_cost: float = DECODE_TOKEN_COST) -> None:
        self._config = {"num_shards": num_shards, "policy": policy, "spill_factor": float(spill_factor),
                        "max_entries": max_entries, "decode_cost": float(decode_cost)}
        self._policy = RouterPolicy(**self._config)

    def route(self, items: list[RouteItem], avoid: Sequence[int] = ()) -> list[int]:
        """Shard per RouteItem (prefix chain, est_prefill_work, est_decode_tokens), in order, none in avoid."""
        return self._policy.route_batch(items, avoid)

    def complete(self, completions: list[Completion]) -> None:
        """One Completion per finished request."""
        self._policy.complete_many(completions)

    def drop_shard(self, shard: int) -> None:
        self._policy.drop_shard(shard)

    def config(self) -> dict:
        return dict(self._config)

    def stats(self) -> dict:
        return self._policy.stats()


def start_router(num_shards: int, policy: str = "cumulative", spill_factor: float = 1.25, *,
                 name: str = ROUTER_NAME, namespace: str, lifetime: str | None = None,
                 max_entries: int = 100_000, decode_cost: float = DECODE_TOKEN_COST) -> ray.actor.ActorHandle:
    """The named router, created or, when one of that name already lives in the namespace, joined.
    Joining a router configured differently raises ValueError naming the differing fields.
    lifetime="detached" keeps it alive after the creating driver exits."""
    config = {"num_shards": num_shards, "policy": policy, "spill_factor": float(spill_factor),
              "max_entries": max_entries, "decode_cost": float(decode_cost)}
    RouterPolicy(**config)  # bad values raise here, in the caller, not in a dead actor
    if lifetime not in (None, "detached", "non_detached"):
        raise ValueError(f"lifetime must be None, 'detached' or 'non_detached'; got {lifetime!r}")
    handle = Router.options(name=name, namespace=namespace, get_if_exists=True, lifetime=lifetime).remote(**config)
    running = ray.get(handle.config.remote())
    diff = {k: (running[k], v) for k, v in config.items() if running[k] != v}
    if diff:
        raise ValueError(f"router {name!r} in namespace {namespace!r} already runs with a different "
                         "configuration: " + ", ".join(f"{k}={a!r} (asked {b!r})" for k, (a, b) in diff.items()))
    return handle
