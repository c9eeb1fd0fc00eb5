"""init_ray without an address starts a Ray of its own even when another Ray on this machine is the one `ray start`
(here ray.cluster_utils.Cluster) registered as current, which a bare ray.init() joins. CI, 2026-12-03: under two
xdist workers a benchmark's service joined the multi-node test's cluster, and its shard, placed on a node that test
then removed, died unschedulable."""
import ray
from ray.cluster_utils import Cluster

from flame_llm.serving.ray_attach import init_ray
from flame_llm.serving.service_config import ServiceConfig


def test_a_local_ray_is_started_beside_a_cluster_registered_as_current(tiny_llama):
    other = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        ray.shutdown()  # this process attached to none: init_ray would otherwise keep what it has
        cfg = ServiceConfig.from_kwargs(model=tiny_llama, num_cpus=3, namespace="ray-local-test")
        assert init_ray(cfg) is True
        try:
            # ours has the 3 CPUs asked for; the registered cluster has 1 (a joined one would show that)
            assert ray.get_runtime_context().gcs_address != other.address
            assert ray.cluster_resources().get("CPU") == 3 and len(ray.nodes()) == 1
        finally:
            ray.shutdown()
    finally:
        other.shutdown()
