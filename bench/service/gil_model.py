"""A model of the engine process's GIL on CPU (issue 39): can the callers' loop in the engine's process delay its
step launches enough to cost ~2 ms a step?

On the H200 under load our steps came every 12.3 ms where vLLM's came every 10.3 ms, while an isolated decode step is
within 3% of vLLM's. vLLM's engine core has a process of its own; ours shares one with the callers' asyncio loop
(serve-http's SSE, the actor's stream server). This models that process without a GPU:

- a "GPU" thread runs each launched step for --gpu-ms (a sleep: the GIL is free, as in a CUDA sync);
- the engine thread, scheduling asynchronously as LLMEngine does: prepare and launch step N+1 (--host-ops small
  torch ops, each of which lets the GIL go and takes it back, plus --host-py-us of pure Python), then wait for step
  N, then hand its tokens to the loop (one call_soon_threadsafe);
- the callers' loop: per hand-off, per stream (--streams), an SSE event built with json.dumps and written to a real
  socket (drained by a thread that reads it).

Variants, interleaved round by round: `alone` (no loop work), `loop` (the loop in the same process), `loop-0.5ms`
(the same with sys.setswitchinterval(0.5 ms)), `loop-process` (the loop's work in a child process, tokens sent over a
pipe: the engine_process layout). Printed per variant: the step period, the GPU's idle share, and the engine
thread's host time a step.

    python -m bench.service.gil_model --steps 400 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import queue
import socket
import statistics
import sys
import threading
import time

import torch

log = logging.getLogger(__name__)
VARIANTS = ("alone", "loop", "loop-0.5ms", "loop-process")


def _sse_work(tokens: list[int], writer: socket.socket, py_us: float = 0.0) -> None:
    """What a callers' loop does per step: one SSE event per stream (and py_us of other Python: detokenizing, the
    HTTP layer's framing), written."""
    for i, tok in enumerate(tokens):
        end = time.perf_counter() + py_us / 1e6
        while time.perf_counter() < end:
            pass
        event = {"id": f"cmpl-{i}", "object": "text_completion", "created": 0, "model": "m",
                 "choices": [{"index": 0, "text": f"t{tok}", "logprobs": None, "finish_reason": None}]}
        writer.sendall(b"data: " + json.dumps(event).encode() + b"\n\n")


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass


def _child_loop(conn, py_us: float) -> None:  # the loop's work in a process of its own
    a, b = socket.socketpair()
    threading.Thread(target=_drain, args=(b,), daemon=True).start()
    while True:
        msg = conn.recv()
        if msg is None:
            return
        _sse_work(msg, a, py_us)


def run_variant(variant: str, a) -> dict:
    sys.setswitchinterval(0.0005 if variant == "loop-0.5ms" else 0.005)
    launches: queue.Queue = queue.Queue()
    gpu_idle = [0.0]

    def gpu() -> None:
        while True:
            t0 = time.perf_counter()
            item = launches.get()
            gpu_idle[0] += time.perf_counter() - t0
            if item is None:
                return
            time.sleep(a.gpu_ms / 1000)
            item.set()

    loop = asyncio.new_event_loop()
    wsock, rsock = socket.socketpair()
    threading.Thread(target=_drain, args=(rsock,), daemon=True).start()
    lt = threading.Thread(target=loop.run_forever, daemon=True)
    lt.start()
    child = parent_conn = None
    if variant == "loop-process":
        parent_conn, child_conn = mp.Pipe()
        child = mp.get_context("spawn").Process(target=_child_loop, args=(child_conn, a.loop_py_us), daemon=True)
        child.start()
    x, y, out = torch.ones(8), torch.ones(8), torch.empty(8)
    tokens = list(range(a.streams))
    gt = threading.Thread(target=gpu, daemon=True)
    gt.start()
    host = 0.0
    inflight = None
    t_start = None
    for step in range(a.steps + 20):
        if step == 20:  # past the warm-up: the clock starts with the GPU busy
            t_start, host, gpu_idle[0] = time.perf_counter(), 0.0, 0.0
        t0 = time.perf_counter()
        for _ in range(a.host_ops):
            torch.add(x, y, out=out)  # lets the GIL go and takes it back, as the host path's torch calls do
        end = time.perf_counter() + a.host_py_us / 1e6
        while time.perf_counter() < end:  # the scheduler's and step inputs' Python
            pass
        done = threading.Event()
        launches.put(done)
        host += time.perf_counter() - t0
        if inflight is not None:
            inflight.wait()
            t1 = time.perf_counter()
            if variant in ("loop", "loop-0.5ms"):
                loop.call_soon_threadsafe(_sse_work, tokens, wsock, a.loop_py_us)
            elif variant == "loop-process":
                parent_conn.send(tokens)
            host += time.perf_counter() - t1
        inflight = done
    inflight.wait()
    wall = time.perf_counter() - t_start
    launches.put(None)
    gt.join()
    loop.call_soon_threadsafe(loop.stop)
    lt.join()
    if child is not None:
        parent_conn.send(None)
        child.join(10)
    wsock.close()
    sys.setswitchinterval(0.005)
    return {"variant": variant, "step_ms": 1e3 * wall / a.steps, "gpu_idle_pct": 100 * gpu_idle[0] / wall,
            "host_ms": 1e3 * host / a.steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.service.gil_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gpu-ms", type=float, default=10.0, help="a step's GPU time (H200, ~19 rows x 8K: ~10 ms)")
    p.add_argument("--host-ops", type=int, default=60, help="torch calls on the host path a step")
    p.add_argument("--host-py-us", type=float, default=1000.0, help="pure-Python host time a step")
    p.add_argument("--streams", type=int, default=19, help="streams handed a token a step")
    p.add_argument("--loop-py-us", type=float, default=0.0, help="more pure-Python loop time per stream's event")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    rows = []
    for r in range(a.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for v in order:
            rows.append({"round": r, **run_variant(v, a)})
            log.info("%s", rows[-1])
    summary = {v: {k: statistics.median(x[k] for x in rows if x["variant"] == v)
                   for k in ("step_ms", "gpu_idle_pct", "host_ms")} for v in VARIANTS}
    log.info("| variant | step ms | GPU idle %% | engine host ms a step |\n|---|---|---|---|\n%s",
             "\n".join(f"| {v} | {s['step_ms']:.2f} | {s['gpu_idle_pct']:.1f} | {s['host_ms']:.2f} |"
                       for v, s in summary.items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
