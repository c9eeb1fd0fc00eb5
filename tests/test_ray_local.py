"""init_ray without an address starts a Ray of its own even when another Ray on this machine is the one `ray start`
(here ray.cluster_utils.Cluster) registered as current, which a bare ray.init() joins. CI, 2026-12-03: under two
xdist workers a benchmark's service joined the multi-node test's cluster, and its shard, placed on a node that test
then removed, died unschedulable."""
import subprocess
import sys
import time

import ray
from ray.cluster_utils import Cluster

from flame_llm.serving.ray_attach import init_ray, local_addresses
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


def test_a_cluster_another_process_ran_is_not_seen_after_it_ended():
    """Ray's lookup of this machine's clusters caches its first answer for the process's life: without clearing it,
    a process that saw another's cluster (the README test's wait, a second service of one process) would see it
    after it ended."""
    code = ("import ray; ray.init(address='local', num_cpus=1, include_dashboard=False); "
            "print(ray.get_runtime_context().gcs_address, flush=True); input()")
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = other.stdout.readline().strip()
        assert address and address in local_addresses()
    finally:
        other.communicate("\n", timeout=60)  # its ray.init's atexit stops the cluster
    deadline = time.monotonic() + 30
    while address in local_addresses():
        assert time.monotonic() < deadline, f"{address} still listed 30 s after its process ended"
        time.sleep(0.5)
