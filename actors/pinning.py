"""Shard placement: which node and which GPU (by UUID) each engine actor owns.

Ray hands out GPUs by index and has no "give me this UUID" request, so placement is two steps:
1. Ray schedules the actor onto the planned node (hard NodeAffinitySchedulingStrategy) with
   num_gpus=1, so Ray's accounting never puts more of our actors on a node than it has GPUs.
2. Inside the actor, before anything initialises CUDA, CUDA_VISIBLE_DEVICES is set to the planned
   UUID (CUDA accepts UUIDs there), replacing the index Ray chose. torch then sees exactly that
   device as cuda:0, and `verify_device` checks it through torch and fails loudly otherwise.
The plan gives every (node, UUID) to one shard only, so two of our actors never share a GPU; a
restarted actor is re-created with the same constructor arguments, so it returns to the same UUID.
A per-GPU custom resource would need every node started with those resources declared, which a
joined cluster may not have; node affinity works on any cluster.

Without GPUs, shards are CPU shards named cpu-0, cpu-1, ... spread round-robin over the nodes.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field

from flame_llm.validate import check, check_int, check_number, is_int

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PlacementConfig:
    """Where shards go (the service YAML's `placement` section)."""
    num_shards: int | str = "auto"  # "auto": one per GPU on every node, or cpu_shards without GPUs
    cpu_shards: int = 2  # shards on a cluster without GPUs
    cpu_per_shard: float = 0.5  # Ray CPUs reserved by each CPU shard (two fit on a 2-CPU machine)
    gpu_uuids: list[str] = field(default_factory=list)  # restrict to these GPUs (empty: all)
    max_restarts: int = 3  # per engine actor (-1: unlimited); a restarted actor returns to its GPU

    def __post_init__(self) -> None:
        n = self.num_shards
        check(n == "auto" or (is_int(n) and n >= 1), "num_shards", "'auto' or an integer >= 1", n, **_F)
        check_int("cpu_shards", self.cpu_shards, 1, **_F)
        check_number("cpu_per_shard", self.cpu_per_shard, 0, **_F)
        check(isinstance(self.gpu_uuids, list) and all(isinstance(u, str) for u in self.gpu_uuids), "gpu_uuids",
              "a list of GPU UUID strings", self.gpu_uuids, **_F)
        check_int("max_restarts", self.max_restarts, -1, **_F)


_F = {"where": "placement field"}


@dataclass(slots=True, frozen=True)
class NodeGPUs:
    node_id: str
    gpu_uuids: tuple[str, ...]  # "GPU-..." in nvidia-smi index order
    num_ray_gpus: int = 0  # GPUs Ray accounts for on this node


@dataclass(slots=True, frozen=True)
class ShardPlacement:
    shard: int  # 0..n-1, the router's and the results' shard id
    name: str  # "gpu-0", ... or "cpu-0", ...
    node_id: str
    gpu_uuid: str | None  # None for a CPU shard


def parse_nvidia_smi(text: str) -> list[str]:
    """UUIDs, in index order, from `nvidia-smi --query-gpu=index,uuid --format=csv,noheader`."""
    rows = []
    for line in text.strip().splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit() or not parts[1]:
            raise ValueError(f"unexpected nvidia-smi line {line!r}; expected '<index>, <uuid>'")
        rows.append((int(parts[0]), parts[1]))
    return [uuid for _, uuid in sorted(rows)]


def local_gpu_uuids() -> list[str]:
    """This machine's GPU UUIDs via NVML when importable, else nvidia-smi; [] without GPUs."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            return []
        try:
            uuids = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                uuids.append(u.decode() if isinstance(u, bytes) else u)
            return uuids
        finally:
            pynvml.nvmlShutdown()
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    out = subprocess.run([exe, "--query-gpu=index,uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"nvidia-smi failed (exit {out.returncode}): {out.stderr.strip()}")
    return parse_nvidia_smi(out.stdout)


def gpu_slots(nodes: list[NodeGPUs], only_uuids: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(node, UUID) of every GPU a shard may take, node by node: those of `only_uuids` when given, at most as
    many per node as Ray accounts for; ValueError for a GPU listed twice or an asked UUID found nowhere."""
    slots: list[tuple[str, str]] = []
    seen: set[str] = set()
    for node in nodes:
        uuids = [u for u in node.gpu_uuids if not only_uuids or u in only_uuids]
        if node.num_ray_gpus and len(uuids) > node.num_ray_gpus:
            log.warning("node %s: %d GPUs listed but Ray accounts for %d; using the first %d",
                        node.node_id, len(uuids), node.num_ray_gpus, node.num_ray_gpus)
            uuids = uuids[:node.num_ray_gpus]
        for u in uuids:
            if u in seen:
                raise ValueError(f"GPU {u} is listed twice (nodes must not share a GPU)")
            seen.add(u)
            slots.append((node.node_id, u))
    missing = [u for u in only_uuids if u not in seen]
    if missing:
        raise ValueError(f"gpu_uuids: {missing} not found on any node")
    return slots


def plan_shards(nodes: list[NodeGPUs], num_shards: int | str = "auto", cpu_shards: int = 2,
                only_uuids: tuple[str, ...] = ()) -> list[ShardPlacement]:
    """Shard k -> (node, UUID). GPUs are used node by node (nodes in the given order), each at most
    once. "auto": one shard per GPU on every node, or `cpu_shards` CPU shards when there are none."""
    assert nodes, "no alive Ray nodes"
    slots = gpu_slots(nodes, only_uuids)
    if slots:
        n = len(slots) if num_shards == "auto" else num_shards
        if not isinstance(n, int) or not 1 <= n <= len(slots):
            raise ValueError(f"num_shards must be 'auto' or an integer in [1, {len(slots)}] "
                             f"(GPUs in the cluster); got {num_shards!r}")
        return [ShardPlacement(k, f"gpu-{k}", node, uuid) for k, (node, uuid) in enumerate(slots[:n])]
    n = cpu_shards if num_shards == "auto" else num_shards
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_shards must be 'auto' or an integer >= 1; got {num_shards!r}")
    return [ShardPlacement(k, f"cpu-{k}", nodes[k % len(nodes)].node_id, None) for k in range(n)]


def normalize_uuid(uuid: str) -> str:
    """nvidia-smi and NVML say 'GPU-<hex>'; torch gives the bare '<hex>'."""
    u = str(uuid).strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def pin_visible_device(gpu_uuid: str | None) -> None:
    """Make `gpu_uuid` this process's only CUDA device. Must run before CUDA is initialised."""
    if gpu_uuid is None:
        return
    try:
        import torch
        if torch.cuda.is_initialized():
            raise RuntimeError(f"CUDA was initialised before pinning to {gpu_uuid}; the pin would be ignored")
    except ImportError:
        pass
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu_uuid


def check_device(expected_uuid: str, torch_uuid: str, device_count: int, shard: str) -> None:
    """Raise unless exactly one device is visible and it is the expected one."""
    if device_count != 1:
        raise RuntimeError(f"shard {shard}: pinned to {expected_uuid} but torch sees {device_count} CUDA "
                           "devices (expected exactly 1)")
    if normalize_uuid(torch_uuid) != normalize_uuid(expected_uuid):
        raise RuntimeError(f"shard {shard}: pinned to {expected_uuid} "
                           f"but cuda:0 is GPU-{normalize_uuid(torch_uuid)}")


def verify_device(expected_uuid: str, shard: str) -> None:
    import torch

    count = torch.cuda.device_count()
    actual = str(torch.cuda.get_device_properties(0).uuid) if count else ""
    check_device(expected_uuid, actual, count, shard)


def replacement_placement(nodes: list[NodeGPUs], taken: set[tuple[str, str | None]], old: ShardPlacement,
                          only_uuids: tuple[str, ...] = ()) -> ShardPlacement | None:
    """Where shard `old`, whose node is gone, goes now: a GPU shard to a GPU (by UUID, one of `only_uuids` when
    the service was given them) of an alive node that no shard holds, a CPU shard to the alive node with the
    fewest shards (`taken`: the (node, UUID) pairs of the shards that live). None when no GPU is free (the
    caller tries again later)."""
    if not nodes:
        return None
    if old.gpu_uuid is not None:
        held = {u for _, u in taken}
        alive = [u for u in only_uuids if any(u in n.gpu_uuids for n in nodes)]  # the lost node's are gone
        for node_id, u in gpu_slots(nodes, tuple(alive) if only_uuids else ()):
            if u not in held:
                return ShardPlacement(old.shard, old.name, node_id, u)
        return None
    load = {n.node_id: 0 for n in nodes}
    for node_id, _ in taken:
        if node_id in load:
            load[node_id] += 1
    node_id = min(load, key=lambda n: (load[n], n))
    return ShardPlacement(old.shard, old.name, node_id, None)
