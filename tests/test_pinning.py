"""Shard planning and device verification, with fake UUID lists standing in for real GPUs."""
import os

import pytest

from actors.pinning import (
    NodeGPUs,
    check_device,
    normalize_uuid,
    parse_nvidia_smi,
    pin_visible_device,
    plan_shards,
    replacement_placement,
)

FAKE_UUIDS_A = ("GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-aaaaaaaa-0000-0000-0000-000000000001")
FAKE_UUIDS_B = ("GPU-bbbbbbbb-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000001")


def test_parse_nvidia_smi_orders_by_index():
    fake_smi = f"1, {FAKE_UUIDS_A[1]}\n0, {FAKE_UUIDS_A[0]}\n\n"
    assert parse_nvidia_smi(fake_smi) == list(FAKE_UUIDS_A)
    assert parse_nvidia_smi("") == []


def test_parse_nvidia_smi_rejects_garbage():
    with pytest.raises(ValueError, match="unexpected nvidia-smi line"):
        parse_nvidia_smi("No devices were found")


def test_plan_one_shard_per_gpu_on_every_node():
    fake_nodes = [NodeGPUs("node-a", FAKE_UUIDS_A, 2), NodeGPUs("node-b", FAKE_UUIDS_B, 2)]
    plan = plan_shards(fake_nodes)
    assert [(p.shard, p.name) for p in plan] == [(0, "gpu-0"), (1, "gpu-1"), (2, "gpu-2"), (3, "gpu-3")]
    assert [p.node_id for p in plan] == ["node-a", "node-a", "node-b", "node-b"]
    assert [p.gpu_uuid for p in plan] == list(FAKE_UUIDS_A + FAKE_UUIDS_B)
    assert len({p.gpu_uuid for p in plan}) == 4  # never two shards on one GPU
    # same inputs, same plan: a restarted service puts shard k back on the same UUID
    assert plan_shards(fake_nodes) == plan
    assert [p.gpu_uuid for p in plan_shards(fake_nodes, 3)] == list(FAKE_UUIDS_A + FAKE_UUIDS_B[:1])


def test_plan_restricted_to_listed_uuids_and_ray_count():
    fake_nodes = [NodeGPUs("node-a", FAKE_UUIDS_A, 1), NodeGPUs("node-b", FAKE_UUIDS_B, 2)]
    plan = plan_shards(fake_nodes)
    assert [p.gpu_uuid for p in plan] == [FAKE_UUIDS_A[0], *FAKE_UUIDS_B]
    only = plan_shards(fake_nodes, only_uuids=(FAKE_UUIDS_B[1],))
    assert [(p.node_id, p.gpu_uuid) for p in only] == [("node-b", FAKE_UUIDS_B[1])]
    with pytest.raises(ValueError, match="gpu_uuids"):
        plan_shards(fake_nodes, only_uuids=("GPU-fake-missing",))


def test_plan_errors_name_the_limit():
    fake_nodes = [NodeGPUs("node-a", FAKE_UUIDS_A, 2)]
    with pytest.raises(ValueError, match=r"num_shards .*\[1, 2\]"):
        plan_shards(fake_nodes, 3)
    with pytest.raises(ValueError, match="listed twice"):
        plan_shards([NodeGPUs("node-a", FAKE_UUIDS_A, 2), NodeGPUs("node-b", FAKE_UUIDS_A, 2)])
    with pytest.raises(ValueError, match="num_shards"):
        plan_shards([NodeGPUs("node-a", ())], 0)


def test_plan_cpu_shards_round_robin_over_nodes():
    plan = plan_shards([NodeGPUs("node-a", ()), NodeGPUs("node-b", ())])
    assert [(p.shard, p.name, p.node_id, p.gpu_uuid) for p in plan] == [(0, "cpu-0", "node-a", None),
                                                                        (1, "cpu-1", "node-b", None)]
    assert [p.name for p in plan_shards([NodeGPUs("n", ())], 3)] == ["cpu-0", "cpu-1", "cpu-2"]


def test_check_device_accepts_torch_form_and_rejects_mismatch():
    fake_expected = FAKE_UUIDS_A[0]
    check_device(fake_expected, normalize_uuid(fake_expected), 1, "gpu-0")  # torch drops "GPU-"
    check_device(fake_expected, fake_expected.upper(), 1, "gpu-0")
    with pytest.raises(RuntimeError, match="gpu-0: pinned to GPU-aaaaaaaa.*but cuda:0 is GPU-bbbbbbbb"):
        check_device(fake_expected, normalize_uuid(FAKE_UUIDS_B[0]), 1, "gpu-0")
    with pytest.raises(RuntimeError, match="torch sees 2 CUDA devices"):
        check_device(fake_expected, normalize_uuid(fake_expected), 2, "gpu-0")
    with pytest.raises(RuntimeError, match="torch sees 0 CUDA devices"):
        check_device(fake_expected, "", 0, "gpu-0")


def test_pin_visible_device_sets_uuid(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    pin_visible_device(None)  # CPU shard: untouched
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    pin_visible_device(FAKE_UUIDS_A[1])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == FAKE_UUIDS_A[1]


def test_a_lost_gpu_shard_goes_to_a_free_gpu_the_service_may_use():
    """Shard 1 lived on node-b, which is gone: its replacement takes a GPU of node-a that no shard holds, and
    only one of the service's gpu_uuids when it was given them."""
    from actors.pinning import ShardPlacement

    a = NodeGPUs("node-a", FAKE_UUIDS_A + ("GPU-aaaaaaaa-0000-0000-0000-000000000002",), 3)
    old = ShardPlacement(1, "gpu-1", "node-b", FAKE_UUIDS_B[0])
    taken = {("node-a", FAKE_UUIDS_A[0])}
    assert replacement_placement([a], taken, old).gpu_uuid == FAKE_UUIDS_A[1]
    allowed = (FAKE_UUIDS_A[0], a.gpu_uuids[2], FAKE_UUIDS_B[0])  # the service's gpu_uuids (B's are gone)
    new = replacement_placement([a], taken, old, allowed)
    assert (new.shard, new.name, new.node_id, new.gpu_uuid) == (1, "gpu-1", "node-a", a.gpu_uuids[2])
    assert replacement_placement([a], taken | {("node-a", a.gpu_uuids[2])}, old, allowed) is None  # none free
    cpu = replacement_placement([a, NodeGPUs("node-c", ())], {("node-a", None)}, ShardPlacement(0, "cpu-0", "x", None))
    assert (cpu.node_id, cpu.gpu_uuid) == ("node-c", None)  # a CPU shard: the node with the fewest shards
