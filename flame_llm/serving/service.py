"""Start, join, inspect and stop the service: a named router actor plus one engine actor per GPU on
every node (or CPU shards), all in one Ray namespace. Actors are found by name, so any process
attached to the cluster can `connect`."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.engine_actor import CONCURRENCY_GROUPS, EngineActor
from actors.liveness import LIVE_TIMEOUT_S
from actors.pinning import NodeGPUs, ShardPlacement, local_gpu_uuids, plan_shards, replacement_placement
from flame_llm.protocol.types import ShardHealth
from flame_llm.serving.preflight import check_cpu_memory
from flame_llm.serving.ray_attach import (
    SHARD_PREFIX,
    find_service,
    init_ray,
    mark_stop,
    resolve_namespace,
    running_local_address,
    stop_requested,
)
from flame_llm.serving.service_config import ServiceConfig

log = logging.getLogger(__name__)
MAX_CONCURRENCY = 1024  # concurrent calls in an engine actor's default group (its serving loop)
UNHEALTHY_STRIKES = 2  # failed liveness looks in a row before a shard is restarted
LIVE_CALL_GRACE_S = 10.0  # a liveness call answers within its probe's timeout plus this, or counts as failed


@dataclass(slots=True)
class Service:
    cfg: ServiceConfig
    placements: list[ShardPlacement]
    routers: list[ray.actor.ActorHandle]  # router.replicas of them, replica 0 first (router/actor.py)
    actors: dict[int, ray.actor.ActorHandle]
    health: list[ShardHealth] = field(default_factory=list)
    model: str = ""  # the model directory the shards load
    lifetime: str | None = None  # the actors' Ray lifetime ("detached" or None)
    strikes: dict[int, int] = field(default_factory=dict)  # shard -> failed liveness looks in a row
    judged: set[int] = field(default_factory=set)  # shards that passed a look since they (re)started

    @property
    def router(self) -> ray.actor.ActorHandle:
        """Router replica 0 (the one router when router.replicas is 1)."""
        return self.routers[0]

    def supervise(self) -> tuple[list[int], list[int], list[int]]:
        """One look of `flame-llm serve`'s supervisor: (shards replaced because their node is gone, shards
        restarted because they were unhealthy, router replicas started again because they were dead). Nothing
        once the service was stopped (flame-llm stop): its actors are dead on purpose."""
        if stop_requested(self.cfg.ray.namespace):
            return [], [], []
        return self.replace_lost_shards(), self.replace_unhealthy_shards(), self.replace_lost_routers()

    def replace_lost_routers(self) -> list[int]:
        """Start again each router replica that is dead for good (router/actor.py revive_routers)."""
        from router.actor import revive_routers

        ns = self.cfg.ray.namespace
        return revive_routers(self.routers, len(self.placements), self.cfg.router, namespace=ns,
                              lifetime=self.lifetime, shard_names=[f"{SHARD_PREFIX}{p.shard}" for p in self.placements],
                              stopped=lambda: stop_requested(ns))

    def replace_unhealthy_shards(self, probe_timeout_s: float = LIVE_TIMEOUT_S) -> list[int]:
        """Restart each shard whose serving loop is wedged or whose process is out of file descriptors (its `live`
        probe failed, or the call did not answer, UNHEALTHY_STRIKES looks in a row, after it passed one since it
        started: a shard still loading is not judged). Ray restarts the killed actor on its device; the clients'
        restart wait, batch resend and stream resume carry what it had in flight (nothing accepted is lost). The
        shards restarted."""
        refs = {k: a.live.remote(probe_timeout_s) for k, a in self.actors.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=probe_timeout_s + LIVE_CALL_GRACE_S)
        restarted = []
        for k, ref in refs.items():
            try:
                live = ray.get(ref, timeout=0)
                why = live.why
            except ray.exceptions.GetTimeoutError:
                live, why = None, f"its liveness call did not answer within {probe_timeout_s + LIVE_CALL_GRACE_S}s"
            except ray.exceptions.RayError:  # dead or restarting: Ray restarts it, or replace_lost_shards places it
                self.strikes.pop(k, None)
                self.judged.discard(k)
                continue
            if live is not None and live.ok:
                self.strikes.pop(k, None)
                self.judged.add(k)
                continue
            if k not in self.judged:
                continue
            self.strikes[k] = self.strikes.get(k, 0) + 1
            log.warning("shard %s is unhealthy (%d of %d looks): %s", self.placements[k].name, self.strikes[k],
                        UNHEALTHY_STRIKES, why)
            if self.strikes[k] >= UNHEALTHY_STRIKES:
                log.warning("shard %s: restarting it (Ray restarts the actor; its clients resend what it had)",
                            self.placements[k].name)
                ray.kill(self.actors[k], no_restart=False)
                self.strikes.pop(k, None)
                self.judged.discard(k)
                restarted.append(k)
        return restarted

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_actors(list(self.actors.values()), self.routers, timeout_s)

    def replace_lost_shards(self, health_timeout_s: float = 120.0) -> list[int]:
        """Place a new engine actor for each shard whose node is gone (Ray cannot restart an actor held to a dead
        node), on a node with a free slot: a GPU no shard holds, or the CPU node with the fewest shards. The
        shards replaced; one without a free slot waits for the next call (`flame-llm serve` calls this every few
        seconds). Its requests went to the other shards meanwhile; clients find the replacement by its name."""
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        lost = [k for k, p in enumerate(self.placements) if p.node_id not in alive]
        if not lost:
            return []
        nodes = [n for n in discover_nodes() if n.node_id in alive]
        taken = {(p.node_id, p.gpu_uuid) for p in self.placements if p.node_id in alive}
        replaced = []
        for k in lost:
            old = self.placements[k]
            new = replacement_placement(nodes, taken, old, tuple(self.cfg.placement.gpu_uuids))
            if new is None:
                log.warning("shard %s lost its node %s; no free GPU to place it on yet", old.name, old.node_id)
                continue
            ray.kill(self.actors[k], no_restart=True)
            deadline = time.monotonic() + 30.0
            while True:  # the lost actor's name is released shortly after the kill
                try:
                    handle = create_shard(self.cfg, new, self.model, self.lifetime)
                    break
                except ValueError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            ray.get(handle.health.remote(), timeout=health_timeout_s)
            self.actors[k], self.placements[k] = handle, new
            taken.add((new.node_id, new.gpu_uuid))
            replaced.append(k)
            log.warning("shard %s: its node %s is gone; replaced on node %s (%s)", old.name, old.node_id,
                        new.node_id, new.gpu_uuid or "CPU")
        return replaced

    def running(self) -> bool:
        """False once the service's actors were stopped (flame-llm stop) or are gone with their cluster."""
        try:
            if stop_requested(self.cfg.ray.namespace):
                return False
            names = {n["name"] for n in ray.util.list_named_actors(all_namespaces=True)
                     if n["namespace"] == self.cfg.ray.namespace}
        except Exception:  # noqa: BLE001 - the cluster itself is gone
            return False
        from router.replicas import ROUTER_NAME

        return ROUTER_NAME in names


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


def start_service(cfg: ServiceConfig, detached: bool = False, source: str = "the service config") -> Service:
    """Create the router and the engine actors and wait until every shard answers health. Before Ray starts:
    the model and engine fields are checked, CPU shards must fit in this machine's memory, and no other Ray may
    run on this machine when a local one is to be started. `source` names the config in errors."""
    from flame_llm.config import Config
    from flame_llm.models.tiny import resolve_model
    from flame_llm.models.tokenizer import TINY, load_tokenizer

    # the model and the engine fields are checked here, before Ray or any actor starts (a model directory
    # that only the nodes of a joined cluster have is left to the shards to check)
    model = resolve_model(cfg.model)
    if cfg.tokenizer not in ("", TINY) and os.path.isdir(cfg.tokenizer):
        cfg = replace(cfg, tokenizer=os.path.abspath(cfg.tokenizer))
    if os.path.isdir(model) or cfg.ray.address is None:
        model = os.path.abspath(model)
        config = Config.from_kwargs(model, **cfg.engine_kwargs())
        if cfg.tokenizer:  # not a tokenizer, or more ids than the model's vocabulary: the error, before Ray starts
            load_tokenizer(model, cfg.tokenizer, config.model_config.hf_config.vocab_size)
    if not ray.is_initialized():
        check_cpu_memory(cfg, model, source)
        running = running_local_address() if cfg.ray.address is None else None
        if running is not None:
            raise RuntimeError(f"a Ray cluster already runs on this machine ({running}), perhaps another flame-llm "
                               "serve: `flame-llm status` shows its service, `flame-llm stop` ends it; to add this "
                               "service to that cluster set ray.address: auto (--address auto)")
    init_ray(cfg)
    pc = cfg.placement
    placements = plan_shards(discover_nodes(), pc.num_shards, pc.cpu_shards, tuple(pc.gpu_uuids))
    lifetime = "detached" if detached else None
    ns = cfg.ray.namespace
    for name in ray.util.list_named_actors(all_namespaces=True):
        if name["namespace"] == ns and name["name"].startswith(SHARD_PREFIX):
            raise RuntimeError(f"namespace {ns!r} already runs a service ({name['name']}); stop it first "
                               "or choose another namespace")
    mark_stop(ns, stopping=False)  # a stop mark left by the last service in this namespace
    from router.actor import start_routers
    routers = start_routers(len(placements), cfg.router, namespace=ns, lifetime=lifetime,
                            shard_names=[f"{SHARD_PREFIX}{p.shard}" for p in placements])
    actors = {}
    for k, p in enumerate(placements):
        assert p.shard == k
        actors[k] = create_shard(cfg, p, model, lifetime)
    refs = {k: a.health.remote() for k, a in actors.items()}
    health = []
    for k, ref in refs.items():
        try:
            health.append(ray.get(ref, timeout=cfg.ray.startup_timeout_s))
        except Exception as e:
            stop_actors(list(actors.values()), routers, 5.0)
            p = placements[k]
            raise RuntimeError(f"shard {p.name} on node {p.node_id} ({p.gpu_uuid or 'CPU'}) failed to start: "
                               f"{e}") from e
    log.info("service up in namespace %r: %s", ns,
             ", ".join(f"{h.name}@{h.device}/{h.node[:8]}" for h in health))
    return Service(cfg, placements, routers, actors, health, model, lifetime)


def create_shard(cfg: ServiceConfig, p: ShardPlacement, model: str, lifetime: str | None) -> ray.actor.ActorHandle:
    """The engine actor of placement p, named after its shard, held to its node."""
    pc = cfg.placement
    res = {"num_gpus": 1, "num_cpus": 1} if p.gpu_uuid else {"num_cpus": pc.cpu_per_shard}
    remote_cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(EngineActor)
    return remote_cls.options(
        name=f"{SHARD_PREFIX}{p.shard}", namespace=cfg.ray.namespace, lifetime=lifetime,
        max_restarts=pc.max_restarts, max_task_retries=0, max_concurrency=MAX_CONCURRENCY,
        scheduling_strategy=NodeAffinitySchedulingStrategy(p.node_id, soft=False), **res,
    ).remote(p, model, cfg.engine_kwargs(), cfg.shard)


def status(namespace: str | None = None) -> dict:
    namespace = resolve_namespace(namespace)
    routers, actors = find_service(namespace)
    shard_refs = {k: a.stats.remote() for k, a in actors.items()}
    shards = []
    for k, ref in shard_refs.items():
        try:
            shards.append(ray.get(ref, timeout=30))
        except Exception as e:  # a dead or restarting shard is part of the status, not a failure of it
            shards.append({"shard": k, "error": f"{type(e).__name__}: {e}"})
    more = {"router_replicas": [ray.get(r.stats.remote(), timeout=30) for r in routers]} if len(routers) > 1 else {}
    return {"namespace": namespace, "router": ray.get(routers[0].stats.remote(), timeout=30), **more, "shards": shards}


def stop_actors(actors: list, routers: list, timeout_s: float = 30.0) -> None:
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
    for a in [*actors, *routers]:
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass


def stop(namespace: str | None = None) -> int:
    """Stop the service in `namespace`; the number of engine actors stopped. The `flame-llm serve` that started
    it sees its router gone and exits (with the local Ray it started)."""
    namespace = resolve_namespace(namespace)
    routers, actors = find_service(namespace)
    mark_stop(namespace)  # before any kill: a supervisor that sees a dead router then leaves it dead
    stop_actors(list(actors.values()), routers)
    return len(actors)
