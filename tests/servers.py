"""The two front doors as users start them, each in a process of its own, for tests that call them over HTTP:
`flame-llm serve-http` (the engine alone) and `flame-llm serve` (local Ray, engine actors and the front door
actor). Each is a context manager that yields the door's base URL once it answers, and ends the process (serve
stops its shards and the local Ray it started) on the way out; its output goes to a log file, whose end a failed
start shows."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log_path: str, chars: int = 3000) -> str:
    with open(log_path, errors="replace") as f:
        return f.read()[-chars:]


@contextlib.contextmanager
def _process(argv: list[str], log_path: str, cwd: str | None = None) -> Iterator[subprocess.Popen]:
    """`python -m flame_llm.cli ARGV` with this checkout first on the path; SIGTERM on the way out, then SIGKILL."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flame_llm.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                                cwd=cwd, env={**os.environ, "PYTHONPATH": REPO})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


@contextlib.contextmanager
def serve_http(args: list[str], log_path: str, timeout_s: float = 180.0) -> Iterator[str]:
    """`flame-llm serve-http ARGS --host 127.0.0.1 --port P`; yields its URL once /health answers."""
    port = free_port()
    with _process(["serve-http", *args, "--host", "127.0.0.1", "--port", str(port)], log_path) as proc:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, f"serve-http exited early: {_tail(log_path)}"
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, f"serve-http did not come up in {timeout_s:g} s: {_tail(log_path)}"
                time.sleep(0.5)
        yield url


@contextlib.contextmanager
def serve(config: dict, workdir: str, timeout_s: float = 300.0) -> Iterator[str]:
    """`flame-llm serve --config CONFIG --http-port 0` (CONFIG written as YAML into workdir, the process's working
    directory, where its log goes too); yields the front door's URL, read from the "listening on" line, once serve
    says "serving". It starts a local Ray: a test that uses it is marked serial."""
    cfg, log_path = os.path.join(workdir, "service.yaml"), os.path.join(workdir, "serve.log")
    with open(cfg, "w") as f:
        yaml.safe_dump(config, f)
    with _process(["serve", "--config", cfg, "--http-port", "0"], log_path, cwd=workdir) as proc:
        url, deadline = None, time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, f"serve exited early: {_tail(log_path)}"
            with open(log_path, errors="replace") as f:
                lines = f.read().splitlines()
            url = next((x.split()[2] for x in lines if x.startswith("listening on ")), None)
            if url and any(x.startswith("serving") for x in lines):
                break
            assert time.monotonic() < deadline, f"serve did not come up in {timeout_s:g} s: {_tail(log_path)}"
            time.sleep(0.5)
        yield url
