"""Issue 42, router scale-out on real Ray: `router.replicas` router actors share the prefix space by consistent
hashing on the prompt's first routing block (router/replicas.py); the client's RouterReplicas
(router/replica_client.py) routes each request to its replica, fails over to the next one on the ring when a
replica dies mid-stream, and the service's supervisor revives it."""

import asyncio
import random
import time

import numpy as np
import pytest
import ray

from flame_llm import SamplingParams
from flame_llm.protocol.routing_key import Completion, RouteItem, prefix_chain
from flame_llm.serving.client import Client
from flame_llm.serving.ray_attach import find_service, mark_stop, stop_requested
from flame_llm.serving.service import start_service
from flame_llm.serving.service import stop as stop_service
from flame_llm.serving.service_config import ServiceConfig
from router.policy import RouterConfig
from router.replica_client import Charge, RouterReplicas
from router.replicas import VNODES, ReplicaRing


def test_replicas_field_defaults_to_one_and_names_itself_when_wrong():
    assert RouterConfig().replicas == 1 and ServiceConfig().router.replicas == 1
    assert ServiceConfig.from_kwargs(replicas=3).router.replicas == 3
    for bad in (0, -1, 65, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"router field 'replicas' must be an integer in \[1, 64\]"):
            RouterConfig(replicas=bad)


def test_ring_has_256_points_per_replica_and_maps_a_prompt_by_its_first_block():
    ring = ReplicaRing(3)
    assert VNODES == 256 and len(ring._keys) == 3 * 256
    rng = random.Random(0)
    keys = [rng.getrandbits(64) for _ in range(30_000)]
    assert all(9_000 < n < 11_000 for n in ring.shares(keys).values())  # near even
    doc = list(range(3, 600))
    a, b = prefix_chain(doc + [1, 2, 3], "rev"), prefix_chain(doc[:300] + [9] * 300, "rev")
    assert a[0] == b[0] and a[1:] != b[1:]  # same first routing block, different later blocks
    assert ring.owner_of(a) == ring.owner_of(b) == ring.owner(a[0])
    assert ReplicaRing(1).owner_of(a) == 0


class SpyHandle:
    """A stand-in for one router actor handle that records the calls made to it (the one-replica path)."""

    def __init__(self) -> None:
        self.calls = []
        spy = self

        class _Method:
            def __init__(self, name):
                self.name = name

            def remote(self, *args):
                spy.calls.append((self.name, args))

                async def answer():
                    return [0] * len(args[0])

                return answer()

        for m in ("route", "place", "complete", "drop_shard"):
            setattr(self, m, _Method(m))


def test_one_replica_makes_the_same_calls_as_one_router():
    """replicas=1: one route call per batch with every item in order, completions passed on whole (whatever
    charged them), drop_shard once: the calls the client made to its one router before."""
    spy = SpyHandle()
    replicas = RouterReplicas.of(spy)
    items = [RouteItem(prefix_chain([d] * 300, "rev"), 1.0, 4) for d in range(3, 40)]
    shards, charged = asyncio.run(replicas.route(items, [1]))
    assert spy.calls == [("route", (items, [1]))] and shards == [0] * len(items)
    assert set(charged) == {Charge(0, 0)}
    cs = [Completion(0, 1.0, 4, 300, 0)] * 3
    replicas.complete(cs, [Charge(0, 0), Charge(0, 7), Charge(0, 0)])
    assert spy.calls[-1] == ("complete", (cs,))
    replicas.drop_shard(1)
    assert spy.calls[-1] == ("drop_shard", (1,))
    assert replicas.place(items[:1], [0]) == [Charge(0, 0)] and spy.calls[-1] == ("place", (items[:1], [0]))


ENGINE = {
    "max_model_len": 1024,
    "max_num_batched_tokens": 1024,
    "max_num_seqs": 16,
    "cpu_kvcache_gib": 0.0625,
    "block_size": 128,
    "enable_kv_events": True,
}


def _docs(seed, n, doc_len=300):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, doc_len).tolist() for _ in range(n)]


def _served(svc) -> int:
    st = ray.get([a.stats.remote() for a in svc.actors.values()])
    return sum(s["requests"] for s in st)  # requests the engines ran to their end


def _wait_for(cond, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def service(tiny_llama):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = ServiceConfig.from_kwargs(
        model=tiny_llama,
        engine=ENGINE,
        num_shards=3,
        cpu_per_shard=0.5,
        policy="events",
        replicas=2,
        load_view="engines",  # each replica balances on a shared view (its own counts until the engines report)
        load_bucket=512.0,
        namespace="test-router-replicas",
    )
    svc = start_service(cfg)
    client = Client.for_service(svc)
    yield svc, client
    client.close()
    svc.stop(timeout_s=10)
    ray.shutdown()


def test_two_replicas_split_the_prompts_by_ring_and_each_holds_every_shards_events(service):
    svc, client = service
    assert len(svc.routers) == 2 and client.router.num_replicas == 2
    assert len(find_service("test-router-replicas")[0]) == 2
    prompts = [d + [7, 8] for d in _docs(0, 16)]
    before = [ray.get(r.stats.remote()) for r in svc.routers]
    res = client.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2))
    assert [r.error for r in res] == [None] * 16
    after = [ray.get(r.stats.remote()) for r in svc.routers]
    routed = [
        sum(s["routed"] for s in a["shards"]) - sum(s["routed"] for s in b["shards"])
        for a, b in zip(after, before, strict=True)
    ]
    ring = ReplicaRing(2)
    want = [sum(ring.owner_of(prefix_chain(p, client.model_revision)) == r for p in prompts) for r in range(2)]
    assert routed == want and min(want) > 0  # each replica routed exactly its share
    assert len({r.shard for r in res}) > 1
    # every replica pulls every shard's cache events: both know the blocks all shards hold
    _wait_for(lambda: all(ray.get(r.stats.remote())["holdings"]["held"] >= 16 for r in svc.routers))


def test_a_replica_killed_mid_stream_loses_no_request_and_is_revived(service):
    svc, client = service
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = [d + [9] for d in _docs(1, 24)]
    served0 = _served(svc)

    async def one(p):
        out = []
        async for chunk in client.stream_chunks(p, sp):
            out += chunk.token_ids
            if chunk.result is not None:
                return chunk.result, out

    async def waves():
        results = []
        for w in range(6):  # new documents each wave: each asks its replica
            if w == 2:
                ray.kill(svc.routers[1], no_restart=True)  # mid-stream: dead for good
            results += await asyncio.gather(*(one(p) for p in prompts[w * 4 : (w + 1) * 4]))
        return results

    results = asyncio.run(waves())
    assert [r.error for r, _ in results] == [None] * 24
    assert all(len(toks) == 8 and r.output_token_ids == toks for r, toks in results)
    assert len({r.id for r, _ in results}) == 24
    _wait_for(lambda: _served(svc) - served0 == 24)
    time.sleep(1.0)
    assert _served(svc) - served0 == 24  # each request was run by a shard exactly once
    assert client.router.counters["lost"] == 1 and client.router.ring.alive == {0}
    lost, unhealthy, revived = svc.supervise()
    assert revived == [1] and ray.get(svc.routers[1].config.remote())[1].replicas == 2

    def back():  # the client finds it by name on its next route calls and gives it its share back
        client.generate([_docs(int(time.monotonic() * 1000) % 10_000, 1)[0]], SamplingParams(max_tokens=1))
        return client.router.ring.alive == {0, 1}

    _wait_for(back, timeout_s=60)
    assert client.router.counters["revived"] == 1
    res = client.generate([d + [5] for d in _docs(2, 12)], SamplingParams(temperature=0.0, max_tokens=2))
    assert [r.error for r in res] == [None] * 12
    assert sum(s["routed"] for s in ray.get(svc.routers[1].stats.remote())["shards"]) > 0  # its share is back


def test_one_replica_service_runs_one_router_under_its_old_name(tiny_llama, service):
    svc, _ = service
    names = {
        n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if n["namespace"] == "test-router-replicas"
    }
    assert {"flame-router", "flame-router-1"} <= names
    cfg = ServiceConfig.from_kwargs(
        model=tiny_llama,
        engine=ENGINE,
        num_shards=1,  # one engine actor to start beside the module's three: the router is what is looked at
        cpu_per_shard=0.25,
        policy="events",
        namespace="test-router-replicas-one",
    )
    one = start_service(cfg)
    try:
        names = {
            n["name"]
            for n in ray.util.list_named_actors(all_namespaces=True)
            if n["namespace"] == "test-router-replicas-one"
        }
        assert {n for n in names if n.startswith("flame-router")} == {"flame-router"}
        assert one.router is one.routers[0] and len(one.routers) == 1
        with Client.for_service(one) as c:
            assert c.router.num_replicas == 1
            res = c.generate([d + [3] for d in _docs(3, 4)], SamplingParams(temperature=0.0, max_tokens=2))
            assert [r.error for r in res] == [None] * 4
        assert one.supervise()[2] == []
        assert one.running()
        # flame-llm stop (service.stop): the serve process's supervisor must not start the killed router again
        # (it once did when its look fell just after the kill, and that serve then never exited)
        assert stop_service("test-router-replicas-one") == 1
        assert stop_requested("test-router-replicas-one")
        assert one.supervise() == ([], [], []) and one.replace_lost_routers() == []
        assert not one.running()
        names = {n["name"] for n in ray.util.list_named_actors(all_namespaces=True)
                 if n["namespace"] == "test-router-replicas-one"}
        assert not any(n.startswith("flame-") for n in names), names
    finally:
        one.stop(timeout_s=10)
    mark_stop("test-router-replicas-one", stopping=False)
    assert not stop_requested("test-router-replicas-one")
