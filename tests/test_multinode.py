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
        assert {h["shard"]: h["node"] for h in svc.health} == placed  # each actor runs where it was planned
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 512, size=30).tolist() for _ in range(8)]
        res = client.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
        assert [r["error"] for r in res] == [None] * 8
        assert {r["node"] for r in res} == set(placed.values())
        assert all(r["node"] == placed[r["shard"]] for r in res)
    finally:
        client.close()
        svc.stop(timeout_s=10)
