"""Start, join, inspect and stop the service: a named router actor plus one engine actor per GPU on
every node (or CPU shards), all in one Ray namespace. Actors are found by name, so any process
attached to the cluster can `connect`."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.engine_actor import CONCURRENCY_GROUPS, EngineActor
from actors.pinning import NodeGPUs, ShardPlacement, local_gpu_uuids, plan_shards
from flame_llm.serving.service_config import ServiceConfig

log = logging.getLogger(__name__)
SHARD_PREFIX = "flame-shard-"
MAX_CONCURRENCY = 1024  # concurrent submit calls (batches) per engine actor


@dataclass(slots=True)
class Service:
    cfg: ServiceConfig
    placements: list[ShardPlacement]
    router: ray.actor.ActorHandle
    actors: dict[int, ray.actor.ActorHandle]
    health: list[dict] = field(default_factory=list)

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_actors(list(self.actors.values()), self.router, timeout_s)


def init_ray(cfg: ServiceConfig) -> bool:
    """Join cfg.ray.address, or start a local Ray when it is None. True when this call started Ray."""
    if ray.is_initialized():
        return False
    kwargs = {"namespace": cfg.ray.namespace, "logging_level": logging.WARNING, "log_to_driver": False}
    if cfg.ray.address is None:
        # workers of a local Ray inherit this environment: let them import our packages from a checkout
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if root not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])
        ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, **kwargs)
        return True
    ray.init(address=cfg.ray.address, **kwargs)
    return False


@ray.remote(num_cpus=0)
def _node_gpus() -> list[str]:
    return local_gpu_uuids()


def discover_nodes() -> list[NodeGPUs]:
    """Every alive node with the GPU UUIDs it has (queried on the node itself), sorted by node id."""
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"])
    gpu_nodes = [n for n in nodes if n["Resources"].get("GPU", 0) > 0]
    refs = [_node_gpus.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in gpu_nodes]
    uuids = dict(zip((n["NodeID"] for n in gpu_nodes), ray.get(refs), strict=True))
    return [NodeGPUs(n["NodeID"], tuple(uuids.get(n["NodeID"], ())), int(n["Resources"].get("GPU", 0)))
            for n in nodes]


def start_service(cfg: ServiceConfig, detached: bool = False) -> Service:
    """Create the router and the engine actors and wait until every shard answers health."""
    from flame_llm.config import Config
    from flame_llm.models.tiny import resolve_model

    # the model and the engine fields are checked here, before Ray or any actor starts (a model directory
    # that only the nodes of a joined cluster have is left to the shards to check)
    model = resolve_model(cfg.model)
    if os.path.isdir(model) or cfg.ray.address is None:
        model = os.path.abspath(model)
        Config.from_kwargs(model, **cfg.engine_kwargs())
    init_ray(cfg)
    pc = cfg.placement
    placements = plan_shards(discover_nodes(), pc.num_shards, pc.cpu_shards, tuple(pc.gpu_uuids))
    lifetime = "detached" if detached else None
    ns = cfg.ray.namespace
    for name in ray.util.list_named_actors(all_namespaces=True):
        if name["namespace"] == ns and name["name"].startswith(SHARD_PREFIX):
            raise RuntimeError(f"namespace {ns!r} already runs a service ({name['name']}); stop it first "
                               "or choose another namespace")
    from router.actor import start_router
    router = start_router(len(placements), cfg.router, namespace=ns, lifetime=lifetime)
    remote_cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(EngineActor)
    actors = {}
    for k, p in enumerate(placements):
        assert p.shard == k
        res = {"num_gpus": 1, "num_cpus": 1} if p.gpu_uuid else {"num_cpus": pc.cpu_per_shard}
        actors[k] = remote_cls.options(
            name=f"{SHARD_PREFIX}{k}", namespace=ns, lifetime=lifetime, max_restarts=pc.max_restarts,
            max_task_retries=0, max_concurrency=MAX_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(p.node_id, soft=False), **res,
        ).remote(p, model, cfg.engine_kwargs(), cfg.shard)
    refs = {k: a.health.remote() for k, a in actors.items()}
    health = []
    for k, ref in refs.items():
        try:
            health.append(ray.get(ref, timeout=cfg.ray.startup_timeout_s))
        except Exception as e:
            stop_actors(list(actors.values()), router, 5.0)
            p = placements[k]
            raise RuntimeError(f"shard {p.name} on node {p.node_id} ({p.gpu_uuid or 'CPU'}) failed to start: "
                               f"{e}") from e
    log.info("service up in namespace %r: %s", ns,
             ", ".join(f"{h['name']}@{h['device']}/{h['node'][:8]}" for h in health))
    return Service(cfg, placements, router, actors, health)


def find_service(namespace: str) -> tuple[ray.actor.ActorHandle, dict[int, ray.actor.ActorHandle]]:
    from router.actor import ROUTER_NAME

    names = [n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if n["namespace"] == namespace]
    shards = sorted(int(n[len(SHARD_PREFIX):]) for n in names if n.startswith(SHARD_PREFIX))
    if not shards or ROUTER_NAME not in names:
        raise RuntimeError(f"no flame-llm service in Ray namespace {namespace!r} (found actors: {sorted(names)})")
    return (ray.get_actor(ROUTER_NAME, namespace=namespace),
            {k: ray.get_actor(f"{SHARD_PREFIX}{k}", namespace=namespace) for k in shards})


def attach(namespace: str, address: str | None = "auto") -> None:
    """Join the Ray cluster at `address` (no-op when this process already is attached)."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)


def status(namespace: str) -> dict:
    router, actors = find_service(namespace)
    shard_refs = {k: a.stats.remote() for k, a in actors.items()}
    shards = []
    for k, ref in shard_refs.items():
        try:
            shards.append(ray.get(ref, timeout=30))
        except Exception as e:  # a dead or restarting shard is part of the status, not a failure of it
            shards.append({"shard": k, "error": f"{type(e).__name__}: {e}"})
    return {"namespace": namespace, "router": ray.get(router.stats.remote(), timeout=30), "shards": shards}


def stop_actors(actors: list, router, timeout_s: float = 30.0) -> None:
    """Drain and shut down each engine (heap unfrozen, engine thread joined), then kill the actors."""
    refs = []
    for a in actors:
        try:
            refs.append(a.shutdown.remote(timeout_s))
        except Exception:
            pass
    deadline = time.monotonic() + timeout_s
    for r in refs:
        try:
            ray.get(r, timeout=max(0.1, deadline - time.monotonic()))
        except Exception as e:
            log.warning("shutdown of an engine actor failed: %s", e)
    for a in [*actors, router]:
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass


def stop(namespace: str) -> int:
    """Stop the service in `namespace`; the number of engine actors stopped."""
    router, actors = find_service(namespace)
    stop_actors(list(actors.values()), router)
    return len(actors)
