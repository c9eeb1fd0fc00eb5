"""The dead-caller watcher's job lookup (actors/inflight.py) on a real local Ray: it reads only the callers' jobs
(filtered job-info calls, not the whole job table), finds a driver that exited dead, a live one and an unknown
id not; the watcher backs off while every caller lives and aborts a dead caller's requests."""
import asyncio
import subprocess
import sys
import time

import pytest
import ray

from actors import inflight
from actors.inflight import Inflight, dead_jobs


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, namespace="test-inflight")
    yield ray.get_runtime_context()
    ray.shutdown()


def _finished_job(address: str) -> str:
    """The job id (hex) of a driver that connected and exited."""
    out = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={address!r}); "
                          "print(ray.get_runtime_context().get_job_id()); ray.shutdown()"],
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_dead_jobs_reads_only_the_callers_jobs(local_ray):
    me = local_ray.get_job_id()
    gone = _finished_job(local_ray.gcs_address)
    assert gone != me
    assert asyncio.run(dead_jobs({me, gone})) == {gone}
    assert asyncio.run(dead_jobs({me})) == set()
    assert asyncio.run(dead_jobs({"7fffffff"})) == set()  # a job the GCS never saw is not declared dead
    assert asyncio.run(dead_jobs(set())) == set()


def test_the_watcher_backs_off_and_aborts_a_dead_callers_requests(local_ray, monkeypatch):
    monkeypatch.setattr(inflight, "WATCH_INTERVAL_S", 0.05)
    monkeypatch.setattr(inflight, "WATCH_MAX_INTERVAL_S", 0.2)
    me = local_ray.get_job_id()
    gone = _finished_job(local_ray.gcs_address)

    async def scenario() -> tuple[Inflight, list[float], bool, bool]:
        inf = Inflight()
        looks: list[float] = []
        real = inflight.dead_jobs

        async def counted(ids):
            looks.append(time.monotonic())
            return await real(ids)

        monkeypatch.setattr(inflight, "dead_jobs", counted)

        async def serve(rid: str, caller: str) -> bool:
            assert inf.add(rid, caller)
            try:
                await asyncio.sleep(30)
                return False
            except asyncio.CancelledError:
                return inf.was_aborted(rid, caller)
            finally:
                inf.remove(rid, caller)

        live = asyncio.ensure_future(serve("a", me))
        await asyncio.sleep(1.2)  # only a live caller: looks grow apart
        dead = asyncio.ensure_future(serve("b", gone))
        aborted = await asyncio.wait_for(dead, 5)
        live.cancel()
        live_aborted = await asyncio.gather(live, return_exceptions=True)
        return inf, looks, aborted, live_aborted[0]

    inf, looks, aborted, live_aborted = asyncio.run(scenario())
    gaps = [b - a for a, b in zip(looks, looks[1:])]
    assert aborted and not live_aborted and inf.counters["aborted_dead_caller"] == 1
    assert gaps[0] < 0.12 and max(gaps) >= 0.19  # backed off from 0.05 s to the 0.2 s cap while all lived
    assert inf.counters["caller_checks"] == len(looks) and inf.counters["caller_check_s"] > 0


def test_a_request_aborted_twice_counts_once():
    """Two aborts reaching one running request (its client's abort and its stream's end) count one abort."""
    async def scenario() -> tuple[list[int], bool, int]:
        inf = Inflight()
        started = asyncio.Event()

        async def serve() -> bool:
            assert inf.add("r", None)
            started.set()
            try:
                await asyncio.sleep(30)
                return False
            except asyncio.CancelledError:
                return inf.was_aborted("r")
            finally:
                inf.forget("r")
                inf.remove("r", None)

        task = asyncio.ensure_future(serve())
        await started.wait()
        found = [inf.abort(["r"]), inf.abort(["r", "unknown"])]
        return found, await asyncio.wait_for(task, 5), inf.counters["aborted"]

    assert asyncio.run(scenario()) == ([1, 1], True, 1)
