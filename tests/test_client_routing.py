"""The client's routing (flame_llm/serving/routing.py) against a real router actor: a caller that leaves during the
router call does not leave its requests' work counted at the router."""
import asyncio
import uuid

import numpy as np
import pytest
import ray

from flame_llm.protocol.routing_key import estimate_prefill_work, prefix_chain
from flame_llm.protocol.types import Request
from flame_llm.sampling_params import SamplingParams
from flame_llm.serving.pending import ClientCounters, Pending
from flame_llm.serving.routing import ClientRouting
from flame_llm.serving.shard_watch import ShardWatch
from router.actor import start_router
from router.policy import RouterConfig


@pytest.fixture(scope="module")
def router():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    handle = start_router(2, RouterConfig("cumulative"), name=f"router-{uuid.uuid4().hex[:8]}",
                          namespace="test-client-routing")
    yield handle
    ray.kill(handle)
    if started:
        ray.shutdown()


def _outstanding(router) -> list[float]:
    return [s["outstanding_work"] for s in ray.get(router.stats.remote())["shards"]]


def test_a_caller_cancelled_during_the_router_call_leaves_no_work_counted(router):
    async def main():
        loop = asyncio.get_running_loop()
        counters = ClientCounters()
        routing = ClientRouting(router, [0, 1], ShardWatch({}, router, [], 5.0, counters), counters, 5.0)
        batch = [Pending(Request(f"r{i}", np.full(64, i + 3, dtype=np.uint32), SamplingParams()),
                         prefix_chain([i + 3] * 64, "rev"), estimate_prefill_work(64), 0, loop.create_future(),
                         est_decode=16) for i in range(4)]
        task = loop.create_task(routing.route_shards(batch))
        await asyncio.sleep(0)  # the router call is made: the caller leaves before its answer
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        calls = set(getattr(routing, "calls", ()))
        if calls:
            await asyncio.wait(calls, timeout=10)
        await asyncio.sleep(0.5)  # (before the fix: the router answers meanwhile, and nobody takes the work back)

    asyncio.run(main())
    stats = ray.get(router.stats.remote())
    assert sum(s["routed"] for s in stats["shards"]) == 4  # the router did charge them
    for _ in range(100):
        if _outstanding(router) == [0.0, 0.0]:
            break
        ray.get(router.stats.remote())
    assert _outstanding(router) == [0.0, 0.0]


def test_completions_go_in_one_router_call_per_loop_tick(router):
    """Completions buffered by the client's routing: one `complete` call per loop tick, or per 256 waiting (one call
    per result payload before), all of them reaching the router."""
    from flame_llm.serving.routing import COMPLETIONS_PER_CALL

    counters = ClientCounters()
    d = ClientRouting(router, [0, 1], ShardWatch({}, router, [], 5.0, counters), counters, 5.0)
    before = sum(s["completed"] for s in ray.get(router.stats.remote())["shards"])

    async def main():
        loop = asyncio.get_running_loop()
        ps = [Pending(Request(f"r{i}", np.zeros(4, dtype=np.uint32), SamplingParams()), [], 1.0, 0,
                      loop.create_future()) for i in range(600)]
        for p in ps[:10]:  # ten results of one tick: one call, after the tick
            d.forget(1, [p])
        assert d.counters.complete_calls == 0
        await asyncio.sleep(0)
        assert d.counters.complete_calls == 1
        d.forget(0, ps[10:10 + COMPLETIONS_PER_CALL - 1])  # one short of a full call: it waits for the tick
        assert d.counters.complete_calls == 1
        d.forget(0, ps[9 + COMPLETIONS_PER_CALL:])  # now full: sent at once
        assert d.counters.complete_calls == 2 and not d._completions
        await asyncio.sleep(0)
        assert d.counters.complete_calls == 2

    asyncio.run(main())
    assert sum(s["completed"] for s in ray.get(router.stats.remote())["shards"]) - before == 600
