"""Issue 42 on real Ray: the router actor pulls the engines' cache events and routes a document's questions to the
shard that holds it (not from its own placements: their TTL is 0 here), and a killed router resyncs from the
shards' snapshots."""
import time

import numpy as np
import pytest
import ray

from flame_llm import SamplingParams
from flame_llm.serving.client import Client
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ServiceConfig

ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 1024, "max_num_seqs": 16, "cpu_kvcache_gib": 0.0625,
          "block_size": 128, "enable_kv_events": True}


@pytest.fixture(scope="module")
def service(tiny_llama):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = ServiceConfig.from_kwargs(model=tiny_llama, engine=ENGINE, num_shards=2, cpu_per_shard=0.5,
                                    policy="events", placement_ttl_s=0.0, event_poll_ms=20.0,
                                    namespace="test-router-events")
    svc = start_service(cfg)
    client = Client.for_service(svc)
    yield svc, client
    client.close()
    svc.stop(timeout_s=10)
    ray.shutdown()


def _doc_questions(seed, n, doc_len=600):
    rng = np.random.default_rng(seed)
    doc = rng.integers(3, 512, doc_len).tolist()
    return [doc + rng.integers(3, 512, 8).tolist() for _ in range(n)]


def _holdings(router) -> dict:
    return ray.get(router.stats.remote())["holdings"]


def _wait_for(cond, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_questions_follow_the_engine_that_holds_the_document(service):
    svc, client = service
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    first, *rest = _doc_questions(1, 4)
    (r0,) = client.generate([first], sp)
    _wait_for(lambda: _holdings(svc.router)["held"] >= 4)  # 4 full 128-token blocks of the document published
    before = ray.get(svc.router.stats.remote())["counters"]["held"]
    for q in rest:  # one by one: each is routed after the holdings are known
        (r,) = client.generate([q], sp)
        assert r.shard == r0.shard and r.cached_tokens >= 512
    assert ray.get(svc.router.stats.remote())["counters"]["held"] >= before + len(rest)


def test_a_killed_router_resyncs_from_the_shards_snapshots(service):
    svc, client = service
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    qs = _doc_questions(2, 3)
    (r0,) = client.generate([qs[0]], sp)
    _wait_for(lambda: _holdings(svc.router)["held"] >= 8)
    pid = ray.get(svc.router.stats.remote())["pid"]
    ray.kill(svc.router, no_restart=False)  # Ray restarts it, empty

    def resynced() -> bool:  # the new incarnation (the old one answers until the kill lands) has both snapshots
        st = _try_stats(svc.router) or {}
        return st.get("pid", pid) != pid and st.get("event_feed", {}).get("snapshots", 0) >= 2
    _wait_for(resynced)
    assert _try_stats(svc.router)["holdings"]["held"] >= 8  # both documents are known again, from the snapshots
    for q in qs[1:]:
        (r,) = client.generate([q], sp)
        assert r.shard == r0.shard and r.cached_tokens >= 512 and r.error is None


def _try_stats(router):
    try:
        return ray.get(router.stats.remote(), timeout=5)
    except Exception:
        return None
