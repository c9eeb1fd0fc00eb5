"""Burst pairs as users run them: through `ray job submit` to a Ray cluster started on this machine.

    python -m bench.burst.jobpairs --out /tmp/r -- --systems flame,engine,vllm --traces reuse --pairs 1 --pair-start 2

starts a Ray head here (`ray start --head --block`, on free ports and a temp dir of its own, so another Ray on the
machine is left alone), submits `python -m bench.burst.pairs ARGS --out OUT` with `ray job submit --working-dir <repo>`,
waits for it, writes the job's logs and status to OUT/jobs/, and stops the head (its process group). Every raw record
the job writes says it ran through `ray job submit` (bench/provenance.py), and so does the report.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from bench import REPO
from bench.http_system import stop_group
from flame_llm.serving import ray_attach

log = logging.getLogger(__name__)
# not uploaded with the working dir: bundles, results, git
EXCLUDES = [".git", ".device", ".vllm", ".whl", ".bundle*", ".gl", "out", "bench/results"]
AGENT_NOT_READY = "No available agent to submit job"  # Ray's answer while the head's job agent registers
SUBMIT_ATTEMPTS = 10
PORT_FLAGS = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port",
              "--node-manager-port", "--object-manager-port")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ray_env() -> dict:
    """`ray start` turns token authentication on (its token in ~/.ray/auth_token): the head and its clients run with
    RAY_AUTH_MODE=token; RAY_ADDRESS is dropped so nothing attaches to another cluster."""
    return {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "token"}


def ensure_token() -> None:
    """`ray start --head` in token mode will not make a token (only ray.init does): on a machine that never ran Ray,
    such as a fresh GPU machine, generate ~/.ray/auth_token first."""
    if ray_attach.token_available():
        return
    subprocess.run(["ray", "get-auth-token", "--generate"], env=ray_env(), capture_output=True, check=True,
                   timeout=120)
    assert ray_attach.token_available(), "ray get-auth-token --generate made no token where Ray looks for it"


def start_head(num_cpus: int | None, num_gpus: int | None, temp_dir: str, log_path: str) -> tuple:
    """A Ray head in its own session; returns (process, job API address)."""
    ensure_token()
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    cmd = ["ray", "start", "--head", "--block", "--disable-usage-stats", "--include-dashboard", "true",
           "--dashboard-host", "127.0.0.1", "--temp-dir", temp_dir, *[x for kv in ports.items() for x in map(str, kv)]]
    cmd += ["--num-cpus", str(num_cpus)] if num_cpus is not None else []
    cmd += ["--num-gpus", str(num_gpus)] if num_gpus is not None else []
    with open(log_path, "wb") as logf:
        head = subprocess.Popen(cmd, env=ray_env(), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return head, f"http://127.0.0.1:{ports['--dashboard-port']}"


def wait_jobs_api(head: subprocess.Popen, address: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["ray", "job", "list", "--address", address], env=ray_env(), capture_output=True,
                         timeout=60).returncode != 0:
        if head.poll() is not None:
            raise RuntimeError(f"ray start --head exited with {head.returncode} before its job API answered")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Ray head's job API at {address} did not answer in {timeout_s:.0f} s")
        time.sleep(2)


def stop_head(head: subprocess.Popen, timeout_s: float = 90.0) -> None:
    """Stop the head's process group (`ray start --block` stops its cluster; ~30 s on 2 cores): SIGTERM, then
    SIGKILL what remains."""
    stop_group(head, timeout_s)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.killpg(proc.pid, signal.SIGKILL)


def run_streaming(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    """Run cmd with its output passed on as it comes; (exit status, its last 64 KB of output). TimeoutExpired
    past timeout_s (its process group is killed: a child left holding the output would keep the read waiting)."""
    proc = subprocess.Popen(cmd, env=ray_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    timer = threading.Timer(timeout_s, _kill_group, (proc,))
    timer.start()
    tail = ""
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            tail = (tail + line)[-65536:]
        rc = proc.wait()
    finally:
        timed_out = not timer.is_alive() and proc.returncode is not None and proc.returncode < 0
        timer.cancel()
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout_s)
    return rc, tail


def submit(address: str, sid: str, pairs_argv: list[str], timeout_s: float) -> int:
    """`ray job submit` (blocking; it streams the job's output) of bench.burst.pairs; returns its exit status. A head
    whose job API answers may still refuse a submission for a moment (AGENT_NOT_READY: its agent has not
    registered; no job is made): that submission is made again, up to SUBMIT_ATTEMPTS times."""
    runtime_env = {"excludes": EXCLUDES, "env_vars": {k: os.environ[k] for k in ("FLAME_BENCH_COMMIT",)
                                                     if os.environ.get(k)}}
    cmd = ["ray", "job", "submit", "--address", address, "--submission-id", sid, "--working-dir", REPO,
           "--runtime-env-json", json.dumps(runtime_env), "--", "python3", "-m", "bench.burst.pairs", *pairs_argv]
    log.info("%s", " ".join(cmd))
    deadline = time.monotonic() + timeout_s
    try:
        for attempt in range(1, SUBMIT_ATTEMPTS + 1):
            rc, out = run_streaming(cmd, max(1.0, deadline - time.monotonic()))
            if rc == 0 or AGENT_NOT_READY not in out or attempt == SUBMIT_ATTEMPTS:
                return rc
            log.warning("the Ray head refused the submission (%s); again in 3 s (attempt %d of %d)", AGENT_NOT_READY,
                        attempt + 1, SUBMIT_ATTEMPTS)
            time.sleep(3)
    except subprocess.TimeoutExpired:
        log.error("ray job submit ran past %.0f s; stopping job %s", timeout_s, sid)
        subprocess.run(["ray", "job", "stop", "--address", address, sid], env=ray_env(), capture_output=True,
                       timeout=120)
        return 124
    return rc


def run(a: argparse.Namespace) -> int:
    pairs_argv = [x for x in a.pairs_args if x != "--"]
    if "--out" in pairs_argv:
        raise SystemExit("give --out to bench.burst.jobpairs (before --), not to bench.burst.pairs")
    out = os.path.abspath(a.out)
    jobs = os.path.join(out, "jobs")
    os.makedirs(jobs, exist_ok=True)
    sid = a.submission_id or f"pairs-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths live under it
    head, address = start_head(a.num_cpus, a.num_gpus, temp, os.path.join(jobs, f"{sid}-ray-start.log"))
    rc, status = 1, "not submitted"
    try:
        wait_jobs_api(head, address)
        rc = submit(address, sid, [*pairs_argv, "--out", out], a.timeout_s)
        said = subprocess.run(["ray", "job", "status", "--address", address, sid], env=ray_env(),
                              capture_output=True, text=True, timeout=60).stdout
        # "Job 'ID' succeeded" (finished), or "Status for job 'ID': RUNNING" (not)
        m = re.search(r"Job '[^']*' (\w+)|Status for job '[^']*': (\w+)", re.sub(r"\x1b\[[0-9;]*m", "", said))
        status = (m[1] or m[2]).upper() if m else f"unknown: {said[-300:]!r}"
        logs = subprocess.run(["ray", "job", "logs", "--address", address, sid], env=ray_env(), capture_output=True,
                              text=True, timeout=120).stdout
        with open(os.path.join(jobs, f"{sid}.log"), "w") as f:
            f.write(logs)
    finally:
        stop_head(head)
        shutil.rmtree(temp, ignore_errors=True)
    with open(os.path.join(jobs, f"{sid}.json"), "w") as f:
        json.dump({"submission_id": sid, "rc": rc, "status": status, "address": address,
                   "pairs_argv": [*pairs_argv, "--out", out], "working_dir": REPO, "excludes": EXCLUDES}, f, indent=1)
    print(f"ray job {sid}: rc {rc}, {status}; logs in {jobs}")
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.burst.jobpairs", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True,
                   help="the results dir bench.burst.pairs writes (and jobs/ with the job's logs)")
    p.add_argument("--num-cpus", type=int, default=None, help="the Ray head's CPUs (default: Ray's, all)")
    p.add_argument("--num-gpus", type=int, default=None, help="the Ray head's GPUs (default: Ray's, all)")
    p.add_argument("--submission-id", default=None, help="the job's id (default: pairs-<time>-<pid>)")
    p.add_argument("--timeout-s", type=float, default=540.0, help="the job's limit; past it the job is stopped")
    p.add_argument("pairs_args", nargs=argparse.REMAINDER, help="after --: bench.burst.pairs flags (not --out)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
