"""The client's bookkeeping when requests leave it unanswered, on a real local Ray cluster (two CPU shards of the
tiny model, the named router): a shard that dies under a batch, a caller that gives up on requests still queued at
the client (batch window, flow-control credit, overload resend delay). Each request's estimated work leaves the
router's count of its shard exactly once (the router's `routed` and `completed` counts per shard match again), and
a request nobody waits for any more is never sent."""
import asyncio
import threading
import time

import numpy as np
import pytest
import ray

from flame_llm import SamplingParams
from flame_llm.serving.client import Client
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ServiceConfig

ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 1024, "max_num_seqs": 16, "cpu_kvcache_gib": 0.0625}


@pytest.fixture(scope="module")
def service(tiny_llama):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = ServiceConfig.from_kwargs(model=tiny_llama, engine=ENGINE, num_shards=2, cpu_per_shard=0.5,
                                    policy="cumulative", namespace="test-leftovers", max_inflight_requests=8,
                                    max_queued_requests=8)
    svc = start_service(cfg)
    yield svc
    svc.stop(timeout_s=10)
    ray.shutdown()


def _prompts(n, length, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=length).tolist() for _ in range(n)]


def _router_open(svc) -> list[tuple[int, float]]:
    """Per shard: requests charged and not yet completed or forgotten, and their outstanding estimated work."""
    return [(s["routed"] - s["completed"], s["outstanding_work"]) for s in ray.get(svc.router.stats.remote())["shards"]]


def _settled(svc, before, timeout_s: float) -> None:
    """Wait until the router's open counts are `before` again (completions travel without being awaited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = _router_open(svc)
        if [n for n, _ in now] == [n for n, _ in before]:
            break
        assert time.monotonic() < deadline, f"router open (requests, work) per shard {now}; before {before}"
        time.sleep(0.05)
    assert [w for _, w in now] == pytest.approx([w for _, w in before], abs=1e-6)


def _shard_batches(svc) -> int:
    return sum(s["batches"] for s in ray.get([a.stats.remote() for a in svc.actors.values()]))


def _on_loop(client, coro, timeout_s: float = 60):
    return asyncio.run_coroutine_threadsafe(coro, client._loop).result(timeout=timeout_s)


@pytest.mark.parametrize("max_retries", [20, 0])
def test_a_lost_shard_takes_back_its_work_at_the_router(service, max_retries):
    """A shard killed mid-batch: its requests are routed again (max_retries 0: they fail with shard_died). Either
    way the work charged to the dead shard for them leaves the router's count, once: before, it stayed (the
    router's routed - completed for the shard grew by the requests lost there)."""
    svc = service
    client = Client.for_service(svc, max_retries=max_retries)
    try:
        before = _router_open(svc)
        victim = svc.actors[0]
        out = {}
        t = threading.Thread(target=lambda: out.update(res=client.generate(
            _prompts(32, 60, seed=1 + max_retries), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))))
        t.start()
        deadline = time.monotonic() + 60
        while ray.get(victim.stats.remote())["inflight_requests"] == 0:  # mid-burst: the shard is busy
            assert time.monotonic() < deadline
            time.sleep(0.02)
        ray.kill(victim, no_restart=False)
        t.join(timeout=180)
        res = out["res"]
        assert len(res) == 32
        errors = [r.error.code for r in res if r.error is not None]
        if max_retries:
            assert errors == []
        else:
            assert errors and set(errors) == {"shard_died"}
        _settled(svc, before, 10.0)
    finally:
        client.close()
