"""A route call lost mid-call (its router died under it, or was restarting) is routed again, not failed
(flame_llm/serving/routing.py): before, three tries 0.1 and 0.2 s apart failed every request of the batch with
ROUTER_ERROR when the router's restart took longer than that. With router replicas the lost call's requests go to
the next replica on the ring within the same call (router/replica_client.py). And a request the router answered
with a shard the client saw die while the call was out is routed again to the shards left, not failed with that
shard's loss (found by tests/test_router_replicas_multinode.py: two shards lost with their node)."""

import asyncio
import time
import uuid

import numpy as np
import pytest
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError

from flame_llm.protocol.errors import ErrorCode, ErrorInfo
from flame_llm.protocol.routing_key import Completion, RouteItem, estimate_prefill_work, prefix_chain
from flame_llm.protocol.types import Request
from flame_llm.sampling_params import SamplingParams
from flame_llm.serving.pending import ClientCounters, Pending
from flame_llm.serving.routing import ClientRouting
from flame_llm.serving.shard_watch import ShardWatch
from router.actor import replica_name, start_router
from router.policy import RouterConfig
from router.replica_client import RouterReplicas

NS = "test-routing-lost"


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


class FakeSlowRestart:
    """A fake of a router restart slower than the old fixed tries: every route call in the first `down_s` seconds
    fails as a call to a dead or restarting actor does; after, the calls go to the real router."""

    def __init__(self, real, down_s: float, error: Exception) -> None:
        self.real, self.down_s, self.error, self.failed = real, down_s, error, 0
        self.place, self.complete, self.drop_shard, self.config = (
            real.place,
            real.complete,
            real.drop_shard,
            real.config,
        )
        self.until, self.route = None, self

    async def remote(self, items, avoid):
        self.until = self.until or time.monotonic() + self.down_s
        if time.monotonic() < self.until:
            self.failed += 1
            raise self.error
        return await self.real.route.remote(items, avoid)


def _batch(loop, n, seed=0, tokens=512):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(3, 500, size=tokens).astype(np.uint32)
        out.append(
            Pending(
                Request(f"r{seed}-{i}", ids, SamplingParams()),
                prefix_chain(ids, "rev", block=128),
                estimate_prefill_work(tokens),
                0,
                loop.create_future(),
                est_decode=4,
            )
        )
    return out


def _busy_work(n=300_000):
    """A route call that keeps a router at work for a while (one-key chains: cheap to make here)."""
    return [RouteItem([i], 1.0, 1) for i in range(n)]


def _routing(router, counters, restart_timeout_s=30.0, shards=(0, 1)):
    return ClientRouting(router, list(shards), ShardWatch({}, router, [], restart_timeout_s, counters), counters,
                         restart_timeout_s)


@pytest.mark.parametrize("error", [ActorDiedError(), ActorUnavailableError("restarting", b"\0" * 16)])
def test_a_call_lost_to_a_slow_restart_is_routed_again_not_failed(local_ray, error):
    handle = start_router(2, RouterConfig("cumulative"), name=f"r-{uuid.uuid4().hex[:8]}", namespace=NS)
    fake = FakeSlowRestart(handle, down_s=1.0, error=error)  # longer than the old 3 tries (0.3 s)

    async def main():
        counters = ClientCounters()
        batch = _batch(asyncio.get_running_loop(), 8)
        out = await _routing(fake, counters).route_shards(batch)
        return out, counters

    out, counters = asyncio.run(main())
    assert all(isinstance(s, int) and s in (0, 1) for s in out), out
    assert fake.failed >= 3 and counters.route_retries == fake.failed
    ray.kill(handle)


def test_a_call_still_lost_after_restart_timeout_fails_with_router_error(local_ray):
    handle = start_router(2, RouterConfig("cumulative"), name=f"r-{uuid.uuid4().hex[:8]}", namespace=NS)
    fake = FakeSlowRestart(handle, down_s=60.0, error=ActorDiedError())

    async def main():
        batch = _batch(asyncio.get_running_loop(), 2)
        return await _routing(fake, ClientCounters(), restart_timeout_s=0.5).route_shards(batch), batch

    (out, batch) = asyncio.run(main())
    assert [e.code.name for e in out] == ["ROUTER_ERROR"] * 2
    assert all(p.future.result().error.code.name == "ROUTER_ERROR" for p in batch)
    ray.kill(handle)


def test_a_real_router_killed_mid_call_answers_after_its_restart(local_ray):
    """The real thing: the router actor is killed while it routes a large batch; Ray restarts it and the call is
    made again to the restarted (empty) router: every request gets a shard."""
    handle = start_router(2, RouterConfig("cumulative"), name=f"r-{uuid.uuid4().hex[:8]}", namespace=NS)

    async def main():
        counters = ClientCounters()
        batch = _batch(asyncio.get_running_loop(), 64, seed=1)
        busy = handle.route.remote(_busy_work(), [])  # the router works on this first: our call waits behind it
        task = asyncio.ensure_future(_routing(handle, counters).route_shards(batch))
        await asyncio.sleep(0.1)  # the call is in flight
        ray.kill(handle, no_restart=False)
        del busy
        return await task, counters

    out, counters = asyncio.run(main())
    assert all(isinstance(s, int) for s in out)
    assert counters.route_retries >= 1  # it was lost, and made again
    ray.kill(handle)


def test_with_replicas_a_replica_killed_mid_call_fails_over_within_the_call(local_ray):
    base = f"r-{uuid.uuid4().hex[:8]}"
    handles = [
        start_router(2, RouterConfig("cumulative", replicas=2), name=replica_name(base, r), namespace=NS)
        for r in range(2)
    ]
    replicas = RouterReplicas(handles, NS, name=base)

    async def main():
        counters = ClientCounters()
        batch = _batch(asyncio.get_running_loop(), 64, seed=2)
        busy = handles[1].route.remote(_busy_work(), [])  # replica 1 works on this first: our call waits behind it
        task = asyncio.ensure_future(_routing(replicas, counters).route_shards(batch))
        await asyncio.sleep(0.1)
        ray.kill(handles[1], no_restart=True)  # dead for good: its share moves to replica 0
        del busy
        return await task, counters, batch

    out, counters, batch = asyncio.run(main())
    assert all(isinstance(s, int) for s in out)
    assert replicas.ring.alive == {0} and replicas.counters["lost"] == 1
    assert {p.charged.replica for p in batch} == {0}  # every request's work is counted where it lives
    replicas.complete([Completion(p.shard, p.est_work, p.est_decode, 0, 0) for p in batch], [p.charged for p in batch])
    deadline = time.monotonic() + 30
    while sum(s["outstanding_work"] for s in ray.get(handles[0].stats.remote())["shards"]) > 1e-6:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ray.kill(handles[0])


class FakeLossDuringCall:
    """The real router, with a fake of a shard's loss being seen by the client while the first route call is out:
    the shard is avoided when the answer arrives (not when the call was made)."""

    def __init__(self, real, watch, shard: int) -> None:
        self.real, self.watch, self.shard, self.calls = real, watch, shard, []
        self.place, self.complete, self.drop_shard = real.place, real.complete, real.drop_shard
        self.config, self.route = real.config, self

    async def remote(self, items, avoid):
        self.calls.append(list(avoid))
        shards = await self.real.route.remote(items, avoid)
        if len(self.calls) == 1:
            self.watch.avoid[self.shard] = ErrorInfo(ErrorCode.SHARD_UNAVAILABLE, f"shard {self.shard} died")
        return shards


def test_a_request_answered_with_a_shard_lost_during_the_call_is_routed_again(local_ray):
    handle = start_router(2, RouterConfig("cumulative"), name=f"r-{uuid.uuid4().hex[:8]}", namespace=NS)
    forgotten = []

    async def main():
        counters = ClientCounters()
        watch = ShardWatch({}, handle, [], 5.0, counters)
        fake = FakeLossDuringCall(handle, watch, shard=1)
        routing = ClientRouting(fake, [0, 1], watch, counters, 5.0)
        routing.forget = lambda s, ps: forgotten.extend((s, p) for p in ps)  # what leaves the router's count
        batch = _batch(asyncio.get_running_loop(), 8, seed=3)
        return await routing.route_shards(batch), batch, fake, counters

    out, batch, fake, counters = asyncio.run(main())
    assert out == [0] * 8 and all(not p.future.done() for p in batch)  # none failed: all on the shard left
    assert fake.calls == [[], [1]] and counters.route_retries == 1
    assert forgotten and all(s == 1 for s, _ in forgotten)  # what shard 1 was charged leaves the router's count
    ray.kill(handle)
