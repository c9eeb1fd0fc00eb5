import time
import uuid

import pytest
import ray
from ray.exceptions import RayActorError

from flame_llm.protocol.routing_key import estimate_prefill_work, prefix_chain
from router.actor import ROUTER_NAME, Router, start_router
from router.policy import RouterConfig

NS = "test-router"


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def router(local_ray):
    name = f"router-{uuid.uuid4().hex[:8]}"
    handle = start_router(2, RouterConfig("cumulative"), name=name, namespace=NS)
    yield name, handle
    ray.kill(handle)


def _items(docs, rev="rev", n_tokens=2048):
    return [(prefix_chain([d] * n_tokens, rev), estimate_prefill_work(n_tokens), 16) for d in docs]


def test_route_complete_drop_and_stats(router):
    name, r = router  # the first test on this router: its counters start at zero
    shards = ray.get(r.route.remote(_items([1, 1, 1, 2])))
    assert shards[0] == shards[1] == shards[2] != shards[3]
    st = ray.get(r.stats.remote())
    assert st["counters"]["new"] == 2 and st["counters"]["hit"] == 2 and st["policy"] == "cumulative"
    work = estimate_prefill_work(2048)
    ray.get(r.complete.remote([(s, work, 16, 2048, 1024) for s in shards]))
    st = ray.get(r.stats.remote())
    assert [x["outstanding_work"] for x in st["shards"]] == [0.0, 0.0]
    assert sum(x["cached_tokens"] for x in st["shards"]) == 4 * 1024
    ray.get(r.drop_shard.remote(shards[3]))
    assert ray.get(r.stats.remote())["entries"] == 4  # document 1's four blocks remain
    assert ray.get(r.route.remote(_items([1]))) == [shards[0]]  # the router is named: found again
    assert ray.get(ray.get_actor(name, namespace=NS).route.remote(_items([1]))) == [shards[0]]
    with pytest.raises(ValueError, match="no event feed"):  # a cumulative router pulls no cache events
        ray.get(r.poll_events.remote())


def test_joining_reuses_state_and_refuses_a_different_config(router):
    name, r = router
    first = ray.get(r.route.remote(_items([7])))
    again = start_router(2, name=name, namespace=NS)
    assert ray.get(again.route.remote(_items([7]))) == first
    with pytest.raises(ValueError, match="already runs with a different configuration: num_shards=2 \\(asked 3\\), "
                                         "policy='cumulative' \\(asked 'load_guarded'\\)"):
        start_router(3, RouterConfig("load_guarded"), name=name, namespace=NS)


@pytest.mark.parametrize("args, kw, match", [
    ((0,), {}, "num_shards must be an integer >= 1"),
    ((2,), {"config": "nope"}, "config must be a RouterConfig; got 'nope'"),
    ((2,), {"lifetime": "forever"}, "lifetime must be None, 'detached' or 'non_detached'"),
])
def test_bad_config_raises_in_the_caller(local_ray, args, kw, match):
    with pytest.raises(ValueError, match=match):
        start_router(*args, name="never-created", namespace=NS, **kw)
    with pytest.raises(ValueError):
        ray.get_actor("never-created", namespace=NS)


def test_bad_items_raise_value_error_and_the_router_keeps_serving(router):
    _, r = router
    with pytest.raises(ValueError, match="item 0: chain must hold at least 1 hash"):
        ray.get(r.route.remote([([], 1.0, 0)]))
    with pytest.raises(ValueError, match="shard must be an integer in \\[0, 2\\); got 9"):
        ray.get(r.complete.remote([(9, 1.0, 0, 1, 0)]))
    with pytest.raises(ValueError, match="shard must be"):
        ray.get(r.drop_shard.remote(-1))
    assert len(ray.get(r.route.remote(_items([3, 4])))) == 2
    assert ray.get(r.route.remote(_items([3, 4]), [0])) == [1, 1]  # a shard the caller avoids gets nothing
    with pytest.raises(ValueError, match="avoid must leave at least one shard"):
        ray.get(r.route.remote(_items([3]), [0, 1]))


def test_detached_router_is_restarted_with_a_fresh_map(local_ray):
    r = start_router(2, name=ROUTER_NAME, namespace=f"{NS}-detached", lifetime="detached")
    try:
        ray.get(r.route.remote(_items([5])))
        assert ray.get(r.stats.remote())["entries"] == 4
        ray.kill(r, no_restart=False)  # Ray restarts it (max_restarts=-1) with the same arguments
        deadline, st = time.monotonic() + 60, None
        while time.monotonic() < deadline:  # the kill is asynchronous: calls may still reach the old one
            try:
                st = ray.get(r.stats.remote(), timeout=30)
            except RayActorError:
                time.sleep(0.1)
                continue
            if st["entries"] == 0:
                break
            time.sleep(0.1)
        assert st is not None and st["entries"] == 0 and st["counters"]["new"] == 0
        assert ray.get(r.route.remote(_items([5]))) == [0]
    finally:
        ray.kill(r)


def test_router_needs_no_cpu():
    assert Router._default_options["num_cpus"] == 0


def test_a_shard_lost_after_it_was_draining_has_its_prefixes_dropped(local_ray):
    """A node going down drains its shard first (the client avoids it) and then loses it: the loss still tells
    the router to drop the shard's prefixes (they were skipped when the shard was already avoided)."""
    import asyncio

    from flame_llm.protocol.errors import ErrorCode, ErrorInfo
    from flame_llm.protocol.types import EngineLimits, ShardHealth
    from flame_llm.serving.pending import ClientCounters
    from flame_llm.serving.shard_watch import ShardWatch

    r = start_router(2, RouterConfig("cumulative"), name=f"router-{uuid.uuid4().hex[:8]}", namespace=NS)
    try:
        lost = ray.get(r.route.remote(_items([11])))[0]

        async def main():
            health = [ShardHealth(s, f"cpu-{s}", f"cpu-{s}", "node", 0, "m", "rev", "0", False,
                                  EngineLimits.of(512, 2048), 8) for s in (0, 1)]
            watch = ShardWatch({0: None, 1: None}, r, health, 1.0, ClientCounters())
            watch.avoid_shard(lost, ErrorInfo(ErrorCode.DRAINING, "draining"))
            watch.lose_shard(lost, RayActorError())
            assert watch.avoid[lost].code is ErrorCode.SHARD_UNAVAILABLE
            await watch.stop()

        asyncio.run(main())
        deadline = time.monotonic() + 10  # drop_shard is sent without waiting
        while ray.get(r.stats.remote())["counters"]["dropped"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ray.get(r.stats.remote())["counters"]["dropped"] == 4  # the document's four 256-token blocks
    finally:
        ray.kill(r)


def test_a_placement_told_without_waiting_is_counted(local_ray):
    """Router.place (a client placed a stream itself): fired without waiting, then completed, it leaves the
    router's counts as a routed request would; a bad placement raises in the caller of ray.get."""
    r = start_router(2, RouterConfig("cumulative"), name=f"router-{uuid.uuid4().hex[:8]}", namespace=NS)
    try:
        (item,) = _items([21])
        r.place.remote([item], [1])  # fire and forget, as the client does
        st = ray.get(r.stats.remote())  # the actor runs one call at a time, in order from one caller
        assert st["counters"]["placed"] == 1 and st["shards"][1]["routed"] == 1
        assert st["shards"][1]["outstanding_work"] > 0
        assert ray.get(r.route.remote(_items([21]))) == [1]  # the placed prefix is the shard's now
        r.complete.remote([(1, item[1], item[2], 2048, 0)] * 2)
        assert [s["outstanding_work"] for s in ray.get(r.stats.remote())["shards"]] == [0.0, 0.0]
        with pytest.raises(ValueError, match="shard must be an integer in"):
            ray.get(r.place.remote([item], [5]))
    finally:
        ray.kill(r)
