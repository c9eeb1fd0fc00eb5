"""Two raylet nodes on one machine (ray.cluster_utils.Cluster, as Ray's own tests do): shards are
placed on both nodes and every result names the node that served it."""
import os

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

from flame_llm import SamplingParams
from flame_llm.serving.client import Client
from flame_llm.serving.service import discover_nodes, start_service
from flame_llm.serving.service_config import ServiceConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster():
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = REPO  # the nodes' workers import our packages from the checkout
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def test_shards_on_both_nodes_and_results_name_them(cluster, tiny_llama):
    nodes = discover_nodes()
    assert len(nodes) == 2 and all(n.gpu_uuids == () for n in nodes)
    cfg = ServiceConfig.from_kwargs(model=tiny_llama, num_shards=2, cpu_per_shard=0.5, namespace="multinode",
                        policy="round_robin", address=cluster.address,
                        engine={"max_model_len": 512, "max_num_batched_tokens": 512, "cpu_kvcache_gib": 0.03125})
    svc = start_service(cfg)
    client = Client.for_service(svc)
    try:
        placed = {p.shard: p.node_id for p in svc.placements}
        assert set(placed.values()) == {n.node_id for n in nodes}
        assert {h.shard: h.node for h in svc.health} == placed  # each actor runs where it was planned
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 512, size=30).tolist() for _ in range(8)]
        res = client.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
        assert [r.error for r in res] == [None] * 8
        assert {r.node for r in res} == set(placed.values())
        assert all(r.node == placed[r.shard] for r in res)
    finally:
        client.close()
        svc.stop(timeout_s=10)


def test_a_lost_node_loses_no_request_and_its_shard_is_replaced(cluster, tiny_llama):
    """Issue 14: a node leaves mid-burst. Its shard's requests move to the surviving shard (nothing fails), the
    router drops its prefixes, and a replacement actor is placed on the surviving node; later requests routed to
    that shard are served by the replacement."""
    import threading
    import time

    node = cluster.add_node(num_cpus=1)  # a node of this test's own, to lose
    cluster.wait_for_nodes()
    cfg = ServiceConfig.from_kwargs(model=tiny_llama, num_shards=2, cpu_per_shard=0.5, namespace="node-loss",
                                    policy="cumulative", address=cluster.address, max_restarts=1,
                                    engine={"max_model_len": 512, "max_num_batched_tokens": 512,
                                            "cpu_kvcache_gib": 0.03125})
    # the two shards on the head node and on the node to lose
    head_id = ray.get_runtime_context().get_node_id()
    from actors.pinning import ShardPlacement
    from flame_llm.serving import service as service_mod

    plan = [ShardPlacement(0, "cpu-0", head_id, None), ShardPlacement(1, "cpu-1", node.node_id, None)]
    original = service_mod.plan_shards
    service_mod.plan_shards = lambda *a, **k: plan
    try:
        svc = start_service(cfg)
    finally:
        service_mod.plan_shards = original
    client = Client.for_service(svc, restart_timeout_s=60.0)
    try:
        assert ray.get(svc.router.stats.remote())["node"] == head_id  # the routing map lives on the head node
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, 512, size=24).tolist() for _ in range(64)]
        sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        out = {}
        t = threading.Thread(target=lambda: out.update(res=client.generate(prompts, sp)))
        t.start()
        deadline = time.monotonic() + 60
        while ray.get(svc.actors[1].stats.remote())["inflight_requests"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        cluster.remove_node(node)
        t.join(timeout=240)
        res = out["res"]
        assert [r.error for r in res] == [None] * 64
        assert all(len(r.output_token_ids) == 48 for r in res)
        assert any(r.shard == 0 and r.timings["attempts"] > 1 for r in res)  # moved off the lost shard
        # the lost shard's prefixes left it at the router: moved with its requests, routed again at once around it
        # (the client sees the connection end before Ray sees the node gone), or dropped when its loss was heard
        # first; the client tells the router without waiting: poll for it
        deadline = time.monotonic() + 10
        while not any(ray.get(svc.router.stats.remote())["counters"][k] for k in ("dropped", "moved")):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        lost = node.node_id
        assert svc.replace_lost_shards() == [1]
        new_node = svc.placements[1].node_id
        assert new_node != lost and new_node in {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        def fresh():  # unseen prefixes: the shard with the least cumulative work (the replacement) gets them
            return client.generate([rng.integers(3, 512, size=24).tolist() for _ in range(8)],
                                   SamplingParams(temperature=0.0, max_tokens=4))

        later = fresh()
        deadline = time.monotonic() + 30
        while not any(r.shard == 1 for r in later):  # the client routes to shard 1 once it answers again
            assert time.monotonic() < deadline, [r.shard for r in later]
            time.sleep(1.0)
            later = fresh()
        assert [r.error for r in later] == [None] * 8
        assert all(r.node == (new_node if r.shard == 1 else head_id) for r in later)
    finally:
        client.close()
        svc.stop(timeout_s=10)
