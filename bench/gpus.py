"""nvidia-smi helpers for the burst systems: device indices, compute processes, idle waits, and the
placement check (every GPU compute process belongs to the shard planned on that GPU)."""
from __future__ import annotations

import os
import subprocess
import time


def _smi(query: str) -> list[list[str]]:
    """Rows of `nvidia-smi --query-X --format=csv,noheader,nounits`; [] without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[c.strip() for c in line.split(",")] for line in out.stdout.strip().splitlines() if "," in line]


def gpu_apps() -> list[tuple[int, str]]:
    """(pid, GPU UUID) of every compute process nvidia-smi lists."""
    return [(int(p), u) for p, u in _smi("--query-compute-apps=pid,gpu_uuid") if p.isdigit()]


def gpu_index(uuid: str) -> int:
    """nvidia-smi's index (PCI bus order) of a GPU UUID."""
    for idx, u in _smi("--query-gpu=index,uuid"):
        if u == uuid:
            return int(idx)
    raise RuntimeError(f"GPU {uuid} is not on this machine (nvidia-smi -L lists the UUIDs)")


def wait_gpus_idle(devices: list[str], timeout_s: float = 180.0, max_used_mib: int = 4096) -> None:
    """Wait until no process computes on these GPUs and their used memory is back under max_used_mib (the
    previous system has released them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = sorted({u for _, u in gpu_apps() if u in devices})
        full = sorted(u for u, used in _smi("--query-gpu=uuid,memory.used")
                      if u in devices and used.isdigit() and int(used) > max_used_mib)
        if not busy and not full:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"GPUs still in use after {timeout_s}s: processes on {busy}, memory on {full}")
        time.sleep(1.0)


def verify_processes(devices: list[str], pids: list[int], by_session: bool) -> dict:
    """Map each GPU compute process to shard k (its pid is pids[k], or, by_session, its session leader is);
    raise when one computes on another shard's GPU. Unmappable processes (another PID namespace) are listed."""
    owner = {pid: k for k, pid in enumerate(pids) if pid > 0}
    seen, unmapped = set(), []
    for pid, gpu in gpu_apps():
        try:
            # getsid answers 0 when the session leader lives in another PID namespace: unmappable
            k = owner.get(os.getsid(pid) if by_session else pid)
        except OSError:
            k = None
        if k is None:
            unmapped.append([pid, gpu])
        elif gpu != devices[k]:
            raise RuntimeError(f"shard {k} (pid {pids[k]}) computes on {gpu}; planned {devices[k]}")
        else:
            seen.add(k)
    return {"verified_by": "nvidia-smi compute processes", "verified_shards": sorted(seen),
            "unmapped_gpu_processes": unmapped}
