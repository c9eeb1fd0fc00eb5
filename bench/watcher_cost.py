"""The dead-caller watcher's cost per look (actors/inflight.py), before and after: the whole job table read in a
thread (`ray._private.state.jobs()`, what it did) against one filtered job-info call per caller on the loop
(`dead_jobs`, what it does), on a local Ray holding `--jobs` finished jobs (drivers that connected and left).

    RAY_ADDRESS= python -m bench.watcher_cost --jobs 60 --callers 2 --out watcher.json
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import ray
import ray._private.state

from actors.inflight import dead_jobs
from bench.provenance import write_json


def old_dead_jobs(job_ids: set[str]) -> set[str]:
    """The watcher before: the whole job table, parsed in Python."""

    return {j["JobID"] for j in ray._private.state.jobs() if j["IsDead"] and j["JobID"] in job_ids}


async def _time(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=60, help="finished jobs to leave in the table first")
    p.add_argument("--callers", type=int, default=2, help="caller jobs with requests in flight (1 live + dead ones)")
    p.add_argument("--looks", type=int, default=300)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    addr = ray.get_runtime_context().gcs_address
    t0 = time.time()
    for k in range(0, a.jobs, 8):  # 8 drivers at a time: each is a job that ends
        procs = [subprocess.Popen([sys.executable, "-c", f"import ray; ray.init(address={addr!r}); ray.shutdown()"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for _ in range(min(8, a.jobs - k))]
        for q in procs:
            q.wait()
    table = ray._private.state.jobs()
    me = ray.get_runtime_context().get_job_id()
    dead = [j["JobID"] for j in table if j["IsDead"]]
    callers = {me, *dead[:max(a.callers - 1, 0)]}
    assert old_dead_jobs(callers) == asyncio.run(dead_jobs(callers)) == callers - {me}, "both find the same dead"

    async def old():
        await asyncio.to_thread(old_dead_jobs, callers)

    async def new():
        await dead_jobs(callers)

    async def both():
        return await _time(old, a.looks), await _time(new, a.looks)

    t_old, t_new = asyncio.run(both())
    cpu0 = time.process_time()
    for _ in range(a.looks):
        old_dead_jobs(callers)
    cpu_old = (time.process_time() - cpu0) / a.looks
    cpu0 = time.process_time()
    asyncio.run(_time(new, a.looks))
    cpu_new = (time.process_time() - cpu0) / a.looks

    def med(xs):
        return sorted(xs)[len(xs) // 2]

    res = {"jobs_in_table": len(table), "callers": len(callers), "looks": a.looks, "setup_s": time.time() - t0,
           "old_ms_p50": 1e3 * med(t_old), "new_ms_p50": 1e3 * med(t_new),
           "old_cpu_ms": 1e3 * cpu_old, "new_cpu_ms": 1e3 * cpu_new}
    ray.shutdown()
    print("| jobs in table | callers | whole table, thread: wall / CPU ms | filtered, loop: wall / CPU ms |")
    print("|---|---|---|---|")
    print(f"| {res['jobs_in_table']} | {res['callers']} | {res['old_ms_p50']:.3f} / {res['old_cpu_ms']:.3f} | "
          f"{res['new_ms_p50']:.3f} / {res['new_cpu_ms']:.3f} |")
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
