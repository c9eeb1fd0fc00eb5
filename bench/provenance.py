"""Where and from what a raw run record came: the machine (GPU UUIDs and names, host), the code (commit, a digest
of the sources), and the call (one `bench.burst.pairs` invocation: its id, how it was launched, its pair range). A
paired
report may merge records of several device calls on several machines; a pair is only ever formed inside one call
(bench/burst/report_merge.py), so these fields are what it checks."""
from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import json
import os
import platform
import subprocess
import uuid

from bench import REPO
from bench.gpus import _smi

SOURCE_DIRS = ("flame_llm", "actors", "router", "bench")
NOT_SOURCES = ("bench/results",)  # records (and the odd table script beside them): not code a run runs, and not
# uploaded by `ray job submit` (bench.burst.jobpairs excludes it), so a job and a direct call of one tree digest alike
COMMIT_ENV = "FLAME_BENCH_COMMIT"  # set where the tree has no .git (a device machine's copy of the checkout)
JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor in a `ray job submit` entrypoint's env


def machine_info() -> dict:
    """This machine: its GPUs (UUID, name, from nvidia-smi) and host. `id` names it in reports: the sorted GPU UUIDs
    (a device machine's hostname may repeat or change; its GPUs do not), or the host without GPUs."""
    gpus = [{"index": int(i), "uuid": u, "name": n} for i, u, n in _smi("--query-gpu=index,uuid,name")
            if i.isdigit()]
    host_id = ""
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                host_id = f.read().strip()
            break
        except OSError:
            continue
    host = platform.node()
    return {"id": ",".join(sorted(g["uuid"] for g in gpus)) or f"host:{host}", "host": host, "host_id": host_id,
            "gpus": gpus, "gpu_name": gpus[0]["name"] if gpus else "cpu"}


def commit() -> str:
    """FLAME_BENCH_COMMIT if set, else `git rev-parse HEAD` (+ "-dirty" with uncommitted changes), else ""."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return ""


def source_digest() -> str:
    """sha256 (16 hex) over the paths and bytes of the .py files that make the service and the bench: names the code
    that ran where no commit is known, and tells two calls whose sources differ apart."""
    h = hashlib.sha256()
    for top in SOURCE_DIRS:
        for root, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__"
                             and os.path.relpath(os.path.join(root, d), REPO) not in NOT_SOURCES)
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, REPO).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read() + b"\0")
    return h.hexdigest()[:16]


def launch() -> dict:
    """How this process was started: through `ray job submit` (Ray's job supervisor set its job config in our env;
    the submission id is in its metadata) or directly."""
    raw = os.environ.get(JOB_ENV)
    if raw is None:
        return {"via": "direct", "submission_id": None}
    try:
        sub = (json.loads(raw).get("metadata") or {}).get("job_submission_id")
    except (ValueError, AttributeError):
        sub = None
    return {"via": "ray job submit", "submission_id": sub}


def call_info(pair_start: int, pairs: int, argv: list[str]) -> dict:
    """One `bench.burst.pairs` invocation: every raw record it writes carries this, and calls/<id>.json keeps it."""
    now = dt.datetime.now(dt.timezone.utc)
    return {"id": f"{now:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}", "started_at": now.isoformat(),
            "pair_start": pair_start, "pairs": pairs, "argv": argv, "commit": commit(),
            "source_digest": source_digest(), **launch()}


def write_json(path: str | None, record) -> None:
    """A bench script's JSON record at `path` (its --out), when one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)


def read_json(path: str):
    """A record written by write_json, or gzipped beside it (.json.gz: long answers' chunk times make MBs)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)
