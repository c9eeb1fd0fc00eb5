"""Issue 42 on real Ray: real engine actors publish their load with their cache events (kv_events with_load), and a
router on load_view 'engines' places an unseen prefix away from a shard that another client loaded, which it could
not know from its own placements; a router on 'own' (the A/B, over the same shards) does not."""
import concurrent.futures
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import ray

from flame_llm import SamplingParams
from flame_llm.serving.client import Client, make_client
from flame_llm.serving.ray_attach import SHARD_PREFIX
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ServiceConfig
from router.actor import start_router
from router.config import RouterConfig

NS = "test-router-load"
ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 1024, "max_num_seqs": 16, "cpu_kvcache_gib": 0.0625,
          "block_size": 128, "enable_kv_events": True}
OUTSIDE = 8  # requests another client keeps on shard 0 (fewer than max_num_seqs: routed ones are admitted at once)


@pytest.fixture(scope="module")
def service(tiny_llama):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = ServiceConfig.from_kwargs(model=tiny_llama, engine=ENGINE, num_shards=2, cpu_per_shard=0.5, policy="events",
                                    placement_ttl_s=0.0, event_poll_ms=20.0, load_view="engines", namespace=NS)
    svc = start_service(cfg)
    client = Client.for_service(svc)  # routed by the service's router: load_view 'engines'
    # the A/B: a router on its own counts ('own'), fed the same shards' cache events, and a client of it
    own_router = start_router(2, RouterConfig(policy="events", placement_ttl_s=0.0, event_poll_ms=20.0),
                              name="router-own", namespace=NS, shard_names=[f"{SHARD_PREFIX}{s}" for s in range(2)])
    own = make_client(cfg, own_router, svc.actors, namespace=NS)
    yield svc, client, own, own_router
    own.close()
    client.close()
    ray.kill(own_router, no_restart=True)
    svc.stop(timeout_s=10)
    ray.shutdown()


def _prompts(seed: int, n: int, length: int = 100) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, length).tolist() for _ in range(n)]


@contextmanager
def outside_load(svc, seed: int, max_tokens: int = 1000 - 100):
    """Another client's OUTSIDE long requests on shard 0 through a router of its own (the service's router never
    sees them), running until the block exits; then that client aborts what is left."""
    router = start_router(1, name=f"router-outside-{seed}", namespace=NS)
    outside = make_client(svc.cfg, router, {0: svc.actors[0]}, namespace=NS)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run() -> None:
        try:
            outside.generate(_prompts(seed, OUTSIDE), sp)
        except concurrent.futures.CancelledError:  # its close() below
            pass
    burst = threading.Thread(target=run, daemon=True)
    burst.start()
    try:
        yield
    finally:
        outside.close()
        burst.join(timeout=30)
        ray.kill(router, no_restart=True)


def _load(actor):
    return ray.get(actor.kv_events.remote(0, 0, with_load=True))[-1].load


def _wait_for(cond, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s
    while not (v := cond()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return v


def test_kv_events_with_load_reports_the_shards_waiting_and_running_requests(service):
    svc, *_ = service
    a0, a1 = svc.actors[0], svc.actors[1]
    with outside_load(svc, 1):
        load = _wait_for(lambda: (x := _load(a0)).rows == OUTSIDE and x)
        assert load.decode_tokens > OUTSIDE * 100 and _load(a1).rows == 0
        assert all(b.load is None for b in ray.get(a0.kv_events.remote(0, 0)))  # not asked: no load
    load = _wait_for(lambda: (x := _load(a0)).rows == 0 and x)  # the outside client aborted them
    assert load.decode_tokens == 0 and load.prefill_work == 0.0


def test_engines_view_places_an_unseen_prefix_away_from_a_shard_loaded_by_another_client(service):
    svc, client, own, own_router = service
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    with outside_load(svc, 2):
        # the service's router ('engines') has applied a report of shard 0's load (its feed polls every 20 ms)
        _wait_for(lambda: ray.get(svc.router.stats.remote())["view"]["load"][0] > 1000)
        engines = [client.generate([p], sp)[0].shard for p in _prompts(3, 4)]  # one by one: unseen prefixes
        own_shards = [own.generate([p], sp)[0].shard for p in _prompts(4, 4)]
        stats = ray.get(svc.router.stats.remote())
    assert engines == [1, 1, 1, 1]
    assert own_shards[0] == 0 and own_shards.count(0) >= 2  # its own counts: shard 0 looks idle
    assert stats["event_feed"]["loads"] > 0 and stats["view"]["reports"] > 0
    own_stats = ray.get(own_router.stats.remote())
    assert "view" not in own_stats and own_stats["event_feed"]["loads"] == 0  # 'own' pulls no load
