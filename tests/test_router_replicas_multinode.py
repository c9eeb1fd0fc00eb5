"""Issue 42 on two raylets (ray.cluster_utils.Cluster, as tests/test_multinode.py): 4 shards, two on each node, and
2 router replicas. A router replica is killed for good mid-stream, then the node with two shards is lost mid-burst:
every request completes exactly once (one result each, every token), and the supervisor revives the replica."""

import asyncio
import os
import threading
import time

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

from flame_llm import SamplingParams
from flame_llm.serving.client import Client
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ServiceConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = REPO  # the nodes' workers import our packages from the checkout
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def _docs(seed, n, doc_len=200):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, doc_len).tolist() for _ in range(n)]


@pytest.mark.parametrize("policy,load_view", [("cumulative", "own"), ("events", "engines")])
def test_router_kill_and_node_loss_complete_every_request_once(cluster, tiny_llama, policy, load_view):
    """With load_view 'engines' the replicas balance on the loads the shards publish with their cache events, and
    the lost node's shards stop reporting mid-burst."""
    node = cluster.add_node(num_cpus=2)  # the node to lose
    cluster.wait_for_nodes()
    head_id = ray.get_runtime_context().get_node_id()
    from actors.pinning import ShardPlacement
    from flame_llm.serving import service as service_mod

    plan = [ShardPlacement(k, f"cpu-{k}", head_id if k < 2 else node.node_id, None) for k in range(4)]
    cfg = ServiceConfig.from_kwargs(
        model=tiny_llama,
        num_shards=4,
        cpu_per_shard=0.5,
        namespace=f"replicas-nodes-{load_view}",
        policy=policy,
        load_view=load_view,
        replicas=2,
        address=cluster.address,
        max_restarts=1,
        engine={"max_model_len": 512, "max_num_batched_tokens": 512, "cpu_kvcache_gib": 0.03125,
                "enable_kv_events": policy == "events"},
    )
    original = service_mod.plan_shards
    service_mod.plan_shards = lambda *a, **k: plan
    try:
        svc = start_service(cfg)
    finally:
        service_mod.plan_shards = original
    client = Client.for_service(svc, restart_timeout_s=60.0)
    try:
        assert len(svc.routers) == 2 and client.router.num_replicas == 2
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

        async def one(p):
            toks = []
            async for chunk in client.stream_chunks(p, sp):
                toks += chunk.token_ids
                if chunk.result is not None:
                    return chunk.result, toks

        async def waves():
            out = []
            for w, docs in enumerate([_docs(w, 6) for w in range(4)]):
                if w == 1:
                    ray.kill(svc.routers[1], no_restart=True)  # router kill, mid-stream
                out += await asyncio.gather(*(one(d) for d in docs))
            return out

        streamed = asyncio.run(waves())
        assert [r.error for r, _ in streamed] == [None] * 24
        assert all(len(t) == 6 and r.output_token_ids == t for r, t in streamed)
        assert client.router.counters["lost"] == 1

        # node loss mid-burst: shards 2 and 3 go with their node
        prompts = [d + [1] for d in _docs(10, 32, doc_len=40)]
        burst = {}
        t = threading.Thread(target=lambda: burst.update(res=client.generate(prompts, sp)))
        t.start()
        deadline = time.monotonic() + 120
        while sum(ray.get(svc.actors[k].stats.remote())["inflight_requests"] for k in (2, 3)) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        cluster.remove_node(node)
        t.join(timeout=300)
        res = burst["res"]
        assert [r.error for r in res] == [None] * 32
        assert all(len(r.output_token_ids) == 6 for r in res) and len({r.id for r in res}) == 32
        assert all(r.shard in (0, 1) for r in res if r.timings["attempts"] > 1)  # moved off the lost shards

        assert svc.replace_lost_routers() == [1]  # the supervisor's look (supervise() also places lost shards)

        def back():
            client.generate([_docs(int(time.monotonic() * 1000) % 100_000, 1)[0]], SamplingParams(max_tokens=1))
            return client.router.ring.alive == {0, 1}

        deadline = time.monotonic() + 60
        while not back():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        later = client.generate([d + [2] for d in _docs(20, 8)], sp)
        assert [r.error for r in later] == [None] * 8 and all(r.shard in (0, 1) for r in later)
        if load_view == "engines":  # the surviving replica balanced on the loads the shards published
            assert ray.get(svc.routers[0].stats.remote())["event_feed"]["loads"] > 0
    finally:
        client.close()
        svc.stop(timeout_s=10)
