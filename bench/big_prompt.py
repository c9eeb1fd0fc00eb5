"""A 15 MB text prompt against the front door's code (issue 37 item 6): serve-http over the embedded default (its
tokenizer) in a child process, one huge text completion and, sent alongside, a small token-id one; prints each
answer's status and time and the server's RSS before and after. Twice: at the default body limit (8 MiB: a 413
before the body is read) and with the limit raised past the text (the max_model_len text bound's 400).

  python -m bench.big_prompt [--mb 15]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

SERVER = """
import asyncio, sys
from flame_llm import AsyncEngine
from flame_llm.models.tiny import ensure_tiny_default
from flame_llm.serving.http_app import HttpConfig, build_app, start
from flame_llm.serving.http_server import EngineBackend
engine = AsyncEngine.from_args(ensure_tiny_default(), max_model_len=1024, max_num_batched_tokens=1024,
                               cpu_kvcache_gib=0.0625)
cfg = HttpConfig(port=int(sys.argv[1]), max_body_bytes=int(sys.argv[2]))
async def main():
    await start(build_app(EngineBackend(engine, "cpu-0"), cfg), cfg)
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _post(url: str, data: bytes) -> tuple[int, str, float]:
    req = urllib.request.Request(f"{url}/v1/completions", data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()[:160], time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()[:160], time.perf_counter() - t0


def one(mb: float, max_body_bytes: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(max_body_bytes)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}"
        small = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4}).encode()
        for _ in range(3):
            _post(url, small)
        _, _, alone = _post(url, small)
        big = json.dumps({"prompt": "lorem ipsum dolor sit amet " * int(mb * 1e6 / 27)}).encode()
        rss0 = _rss_mb(proc.pid)
        got = {}
        t = threading.Thread(target=lambda: got.update(big=_post(url, big)))
        t.start()
        time.sleep(0.05)
        beside = _post(url, small)
        t.join(timeout=300)
        time.sleep(0.5)
        rss1 = _rss_mb(proc.pid)
        status, body, took = got["big"]
        print(f"max_body_bytes {max_body_bytes}: {len(big) / 1e6:.1f} MB text -> {status} in {took * 1e3:.0f} ms "
              f"({body[:110]}...); a small request alongside: {beside[0]} in {beside[2] * 1e3:.0f} ms (alone "
              f"{alone * 1e3:.0f} ms); server RSS {rss0:.0f} -> {rss1:.0f} MB")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.big_prompt", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=15.0)
    args = p.parse_args(argv)
    one(args.mb, 8 << 20)
    one(args.mb, 64 << 20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
