"""What the client holds for requests that are gone (issue 37 item 10, reported in passing): the router's outstanding
work of requests rerouted after their shard was lost, and a request aborted while it waits in its shard's batch
queue. Neither leaked here at 3cf5b5c (ShardChannel.lost forgets the batch before rerouting it, and
Dispatcher.abandon drops abandoned requests from their batchers): these pin both down. Real local Ray, two CPU
shards of the tiny model (a shard killed once: Ray restarts it), bounded in count and time."""
import asyncio
import time

import numpy as np
import pytest
import ray

from flame_llm import SamplingParams
from flame_llm.serving.client import make_client
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ServiceConfig
from tests.helpers import kill_mid_burst

ENGINE = {"max_model_len": 512, "max_num_batched_tokens": 512, "max_num_seqs": 8, "cpu_kvcache_gib": 0.0625}


@pytest.fixture(scope="module")
def service(tiny_llama):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    svc = start_service(ServiceConfig.from_kwargs(model=tiny_llama, engine=ENGINE, num_shards=2, cpu_per_shard=0.5,
                                                  policy="cumulative", namespace="test-client-leaks",
                                                  max_restarts=-1, restart_timeout_s=120.0))
    yield svc
    svc.stop(timeout_s=10)
    ray.shutdown()


def _outstanding(svc) -> list[float]:
    return [s["outstanding_work"] for s in ray.get(svc.router.stats.remote())["shards"]]


def _wait(cond, timeout_s: float, what) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


class LedgerRouter:
    """The real router handle, with a ledger (a spy, not a fake: every call goes on to the router): per shard, the
    requests routed or placed there and the completions sent for it. Each routed request must be completed (or
    forgotten) exactly once; the router's own count cannot show a missing `forget` on a shard that restarts, as
    the restart's drop_shard clears that shard's count."""

    def __init__(self, router) -> None:
        self.router, self.charged, self.completed = router, {}, {}
        outer = self

        class _Route:
            @staticmethod
            def remote(items, avoid):
                async def call():
                    shards = await outer.router.route.remote(items, avoid)
                    for s in shards:
                        outer.charged[s] = outer.charged.get(s, 0) + 1
                    return shards
                return call()

        class _Place:
            @staticmethod
            def remote(items, shards):
                for s in shards:
                    outer.charged[s] = outer.charged.get(s, 0) + 1
                return outer.router.place.remote(items, shards)

        class _Complete:
            @staticmethod
            def remote(cs):
                for c in cs:
                    outer.completed[c.shard] = outer.completed.get(c.shard, 0) + 1
                return outer.router.complete.remote(cs)

        self.route, self.place, self.complete = _Route, _Place, _Complete
        self.drop_shard, self.stats = router.drop_shard, router.stats

    def balanced(self) -> bool:
        return self.charged == self.completed


def _ledger(client) -> LedgerRouter:
    d = client.dispatch
    ledger = LedgerRouter(d.router.handles[0])
    d.router.handles[0] = ledger  # one RouterReplicas: the dispatcher's, its routing's and its shard watch's
    return ledger


def _prompts(n, length, seed, prefix=()):
    rng = np.random.default_rng(seed)
    return [list(prefix) + rng.integers(3, 500, size=length).tolist() for _ in range(n)]


@pytest.mark.slow
def test_requests_rerouted_after_a_lost_shard_leave_no_work_at_the_router(service):
    svc = service
    for s in svc.actors:
        ray.get(svc.router.drop_shard.remote(s))
    client = make_client(svc.cfg, svc.router, svc.actors)
    ledger = _ledger(client)
    try:
        doc = _prompts(1, 200, seed=5)[0]
        (first,) = client.generate([doc + [1, 2]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        dead = first.shard
        watch = client.dispatch.shards
        burst, out = kill_mid_burst(client, svc.actors[dead], _prompts(6, 8, seed=6, prefix=doc),
                                     SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
        burst.join(timeout=180)
        assert [r.error for r in out["res"]] == [None] * 6
        _wait(lambda: dead not in watch.restarting, 120, lambda: "the shard did not come back")
        _wait(lambda: _outstanding(svc) == [0.0, 0.0], 10, lambda: _outstanding(svc))
        _wait(ledger.balanced, 5, lambda: (ledger.charged, ledger.completed))
    finally:
        client.close()


def test_an_aborted_request_leaves_its_batch_queue_at_once(service):
    svc = service
    client = make_client(svc.cfg, svc.router, svc.actors, batch_window_ms=8000.0)
    try:
        d = client.dispatch
        for b in d.channels.values():  # its requests wait out the window, as resent ones do (a call's formed batch
            real = b.flush  # leaves at once)
            b.flush = lambda why, real=real: None if why == "formed" else real(why)

        async def call():
            return await client.agenerate(_prompts(3, 8, seed=7), SamplingParams(max_tokens=4))

        fut = asyncio.run_coroutine_threadsafe(call(), client._loop)
        _wait(lambda: any(b.items for b in d.channels.values()), 30, lambda: "never queued")
        fut.cancel()
        _wait(lambda: not any(b.items for b in d.channels.values()), 2,
              lambda: {s: len(b.items) for s, b in d.channels.items()})
        _wait(lambda: _outstanding(svc) == [0.0, 0.0], 5, lambda: _outstanding(svc))
    finally:
        client.close()


@pytest.mark.slow
def test_streams_resumed_after_a_lost_shard_leave_no_work_at_the_router(service):
    """The door's path: streams (over the stream socket) whose shard dies mid-stream go on elsewhere; once they
    end and the shard is back, the router counts no work."""
    import threading

    svc = service
    for s in svc.actors:
        ray.get(svc.router.drop_shard.remote(s))
    client = make_client(svc.cfg, svc.router, svc.actors)
    ledger = _ledger(client)
    try:
        doc = _prompts(1, 200, seed=8)[0]
        (first,) = client.generate([doc + [1, 2]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        dead, watch = first.shard, client.dispatch.shards
        sp = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        results: list = []

        def one(prompt) -> None:
            async def run():
                return [c async for c in client.stream_chunks(prompt, sp)][-1].result
            results.append(asyncio.run_coroutine_threadsafe(run(), client._loop).result(timeout=180))

        threads = [threading.Thread(target=one, args=(p,)) for p in _prompts(4, 8, seed=9, prefix=doc)]
        for t in threads:
            t.start()
        _wait(lambda: ray.get(svc.actors[dead].stats.remote())["inflight_requests"] > 0, 60, lambda: "not busy")
        ray.kill(svc.actors[dead], no_restart=False)
        for t in threads:
            t.join(timeout=180)
        assert [r.error for r in results] == [None] * 4
        _wait(lambda: dead not in watch.restarting, 120, lambda: "the shard did not come back")
        _wait(lambda: _outstanding(svc) == [0.0, 0.0], 10, lambda: _outstanding(svc))
        _wait(ledger.balanced, 5, lambda: (ledger.charged, ledger.completed))
    finally:
        client.close()
