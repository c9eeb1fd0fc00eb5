"""The host CPU each streamed output token costs (issue 39), on CPU with the tiny model: sustained streaming through
flame's front door (door actor -> client -> stream socket -> engine actor with its stream server) against
`serve-http` (our engine alone behind HTTP + SSE in one process), the same engine config, windows interleaved.

A window keeps --streams streams open back to back (closed loop: each stream asks --output-tokens tokens, EOS
ignored, of a fresh --prompt-tokens prompt; when one ends the next starts) for --duration-s. Around it every
process of the system is read (psutil: user + system CPU seconds): serve-http's one process; flame's engine actor,
front door and router actors. Per system: output tokens, wall tok/s, each process's CPU microseconds per output
token and their sum, and the engine's process split into its engine thread (the step loop: scheduling, the model,
handing tokens to the loops) and its other threads (serve-http: the HTTP loop; the engine actor: the stream server's
loop and Ray's). The engine step costs the same on both sides at the same batch; what differs is the path. The load
generator (this process) is read too, apart. --py-spy S samples the engine actor and the door for S seconds of one
flame window (py-spy record, raw stacks) and lists the functions holding the most samples (own and inclusive: wall
samples of running threads, so a thread waiting for the GIL inside a call counts there).

    RAY_ADDRESS= python -m bench.service.stream_cpu --streams 8 --output-tokens 256 --duration-s 15 --rounds 2 \
      --out s.json
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import subprocess
import sys
import time

import aiohttp
import numpy as np

from bench.http_client import SERVED_MODEL_NAME
from bench.load.loadgen import Outcome, percentiles, stream_one
from bench.provenance import write_json

log = logging.getLogger(__name__)


def cpu_s(pids: dict[str, int]) -> dict[str, float]:
    import psutil

    out = {}
    for name, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        out[name] = t.user + t.system
    return out


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of a process (native thread id -> user + system)."""
    import psutil

    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def engine_thread_share(before: dict[int, float], after: dict[int, float], engine_tid: int | None) -> tuple[float, str]:
    """(CPU seconds of the engine's step thread over the window, how it was found): the AsyncEngine thread's native
    id where the process tells it (the engine actor), else the busiest thread that is not the main one (serve-http:
    its main thread runs the HTTP loop; the engine thread runs the model and dwarfs the rest)."""
    delta = {t: after[t] - before.get(t, 0.0) for t in after}
    if engine_tid is not None and engine_tid in delta:
        return delta[engine_tid], "its AsyncEngine thread"
    main = min(delta)  # the process's first thread (tid == pid)
    rest = {t: v for t, v in delta.items() if t != main}
    t = max(rest, key=rest.get) if rest else main
    return delta[t], "the busiest thread but the main one"


async def window(url: str, streams: int, out_tokens: int, prompt_tokens: int, vocab: int, duration_s: float,
                 seed: int) -> list[Outcome]:
    """Closed-loop streams for duration_s (a stream started before the end runs to its end)."""
    rng = np.random.default_rng(seed)
    outs: list[Outcome] = []
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)) as s:
        async def loop() -> None:
            while time.perf_counter() - t0 < duration_s:
                out = Outcome(time.perf_counter() - t0, 0, 0, max_tokens=out_tokens)
                outs.append(out)
                await stream_one(s, url, rng.integers(0, vocab, prompt_tokens).tolist(), out_tokens, out,
                                 time.perf_counter(), SERVED_MODEL_NAME)
                if out.error:
                    raise RuntimeError(f"a stream failed: {out.error}")

        await asyncio.gather(*(loop() for _ in range(streams)))
    return outs


def measure(name: str, url: str, pids: dict[str, int], a, vocab: int, seed: int,
            engine: tuple[str, int | None], shard_stats=None) -> dict:
    """engine: (the process that hosts the engine, its engine thread's native id when known). shard_stats: the
    engine actor's stats (flame), whose stream-server output counters are read around the window. With
    engine_process the step loop runs in that process's child ("<process> engine process" in pids): the split is
    then the child's CPU (engine thread) against the host process's (other threads)."""
    proc, tid = engine
    child = f"{proc} engine process"
    sock0 = shard_stats() if shard_stats is not None else {}
    threads0 = thread_cpu_s(pids[proc])
    before, t = cpu_s({**pids, "load generator": os.getpid()}), time.perf_counter()
    outs = asyncio.run(window(url, a.streams, a.output_tokens, a.prompt_tokens, vocab, a.duration_s, seed))
    wall = time.perf_counter() - t
    after = cpu_s({**pids, "load generator": os.getpid()})
    eng_s, how = engine_thread_share(threads0, thread_cpu_s(pids[proc]), tid)
    tokens = sum(o.output_tokens for o in outs)
    sock = {k: v - sock0[k] for k, v in shard_stats().items() if k in sock0} if shard_stats is not None else {}
    per_tok = {k: 1e6 * (after[k] - before[k]) / tokens for k in after}
    if child in pids:  # the step loop's process: all of it is the engine's
        eng_s, how = after[child] - before[child], "its engine process (engine_process)"
        per_tok[proc] += per_tok[child]  # the host's columns stay comparable: host + its engine process
    split = {"engine thread": 1e6 * eng_s / tokens, "found as": how,
             "other threads": per_tok[proc] - 1e6 * eng_s / tokens}
    system = sum(v for k, v in per_tok.items() if k not in ("load generator", child))
    itl = [b - x for o in outs for x, b in zip(o.chunk_s, o.chunk_s[1:])]
    return {"system": name, "streams": len(outs), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "cpu_us_per_token": per_tok, "engine_process_split": split, "system_cpu_us_per_token": system,
            "system_cpu_cores": system * tokens / wall / 1e6, "itl_s": percentiles(itl),
            "chunks_per_token": sum(len(o.chunk_s) for o in outs) / tokens, "stream_out": sock,
            # the stream server's frames per socket write (before its output counters: one write a frame)
            "frames_per_write": sock["socket_out_frames"] / max(1, sock["socket_out_writes"])
            if "socket_out_writes" in sock else None}


def flame_pids(flame) -> tuple[dict[str, int], int | None]:
    """The pids of flame's actors on this one-shard service (and of the engine actor's engine process, with
    engine_process), and the engine actor's engine thread's native id (None with engine_process)."""
    import ray

    actor = next(iter(flame.service.actors.values()))
    door, _ = flame._door
    pid = lambda h: ray.get(h.__ray_call__.remote(lambda self: os.getpid()))  # noqa: E731
    tid, child = ray.get(actor.__ray_call__.remote(
        lambda self: (self.engine._thread.native_id, None) if hasattr(self.engine, "_thread") else
        (None, self.engine.pid)))
    pids = {"engine actor": ray.get(actor.health.remote()).pid, "front door": pid(door),
            "router": pid(flame.service.router)}
    if child is not None:
        pids["engine actor engine process"] = child
    return pids, tid


def serve_http_pids(pid: int) -> dict[str, int]:
    """serve-http's process, and its engine process (its one child, with engine_process)."""
    import psutil

    kids = [c for c in psutil.Process(pid).children() if "spawn_main" in " ".join(c.cmdline())]
    return {"serve-http": pid, **({"serve-http engine process": kids[0].pid} if kids else {})}


def py_spy(pids: dict[str, int], seconds: float, folder: str) -> list[subprocess.Popen]:
    """py-spy record of each pid (raw collapsed stacks, all threads) for `seconds`, in the background."""
    os.makedirs(folder, exist_ok=True)
    return [subprocess.Popen(["py-spy", "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "250", "-f", "raw",
                              "--nonblocking", "-o", os.path.join(folder, f"{name.replace(' ', '-')}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name, pid in pids.items()]


def top_functions(path: str, n: int = 20) -> dict:
    """From py-spy's raw stacks: the functions holding the most samples as the innermost frame (own) and anywhere
    on the stack (inclusive), as % of the samples."""
    own, incl, total = collections.Counter(), collections.Counter(), 0
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  for f in stack.split(";") if f]
        total += k
        if frames:
            own[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    pct = lambda c: [(f, round(100 * v / total, 1)) for f, v in c.most_common(n)]  # noqa: E731
    return {"samples": total, "own_pct": pct(own), "inclusive_pct": pct(incl)}


def table(rows: list[dict]) -> str:
    names = sorted({k for r in rows for k in r["cpu_us_per_token"]})
    lines = ["| system | round | tokens | tok/s | " + " | ".join(f"{n} us/tok" for n in names)
             + " | of the engine's process: engine thread / other threads us/tok | system us/tok | system CPU cores | "
               "ITL p50 / p99 ms | chunks/token | stream frames/write |",
             "|---" * (10 + len(names)) + "|"]
    for r in rows:
        c = r["cpu_us_per_token"]
        lines.append(f"| {r['system']} | {r['round']} | {r['tokens']} | {r['tok_s']:.0f} | "
                     + " | ".join(f"{c[n]:.1f}" if n in c else "-" for n in names)
                     + f" | {r['engine_process_split']['engine thread']:.1f} / "
                       f"{r['engine_process_split']['other threads']:.1f}"
                     + f" | {r['system_cpu_us_per_token']:.1f} | {r['system_cpu_cores']:.2f} | "
                       f"{1e3 * r['itl_s']['p50']:.2f} / {1e3 * r['itl_s']['p99']:.2f} | "
                       f"{r['chunks_per_token']:.2f} | "
                       + (f"{r['frames_per_write']:.2f} |" if r.get("frames_per_write") is not None else "- |"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.service.stream_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--duration-s", type=float, default=15.0)
    p.add_argument("--rounds", type=int, default=2, help="windows per system, interleaved (A B B A ...)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--engine-json", default="{}", help="engine fields of both serve-http and the shard")
    p.add_argument("--client-json", default="{}", help="ClientConfig fields of flame (the door's client)")
    p.add_argument("--py-spy", type=float, default=0.0, help="seconds of py-spy sampling in flame's first window")
    p.add_argument("--logs", default="/tmp/flame-stream-cpu")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    for name, ok in (("--streams", a.streams >= 1), ("--output-tokens", a.output_tokens >= 2),
                     ("--duration-s", a.duration_s > 0), ("--rounds", a.rounds >= 1)):
        if not ok:
            raise SystemExit(f"{name} is out of range: {getattr(a, name[2:].replace('-', '_'))!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import ray

    from bench.burst.runner import RunOptions, build_setup, local_ray_scope
    from bench.system_config import parse_system
    from bench.systems import make_system
    from flame_llm.config import load_hf_config

    o = RunOptions(model=a.model, load_format="auto", num_shards=1, max_model_len=a.max_model_len,
                   max_num_seqs=max(16, a.streams), max_num_batched_tokens=a.max_model_len,
                   engine_json={"cpu_kvcache_gib": 0.25, **json.loads(a.engine_json)})
    setup = build_setup(o, os.path.join(a.logs, "logs"))
    vocab = load_hf_config(setup.model).vocab_size
    rows, spy = [], {}
    with local_ray_scope():
        http = make_system(parse_system("engine"), setup, "stream-cpu-engine")
        flame = make_system(parse_system("flame"), setup, "stream-cpu-flame")
        flame.system.client.update(json.loads(a.client_json))
        try:
            http.start()
            flame.start()
            urls = {"serve-http": http.http_replicas()[0].url, "flame door": flame.http_replicas()[0].url}
            door_pids, tid = flame_pids(flame)
            pids = {"serve-http": serve_http_pids(http.procs[0].pid), "flame door": door_pids}
            engine = {"serve-http": ("serve-http", None), "flame door": ("engine actor", tid)}
            actor = next(iter(flame.service.actors.values()))
            stats = {"serve-http": None, "flame door": lambda: {k: v for k, v in ray.get(actor.stats.remote()).items()
                                                                if k.startswith("socket_out_")}}
            for url in urls.values():  # warm both paths
                asyncio.run(window(url, a.streams, 8, a.prompt_tokens, vocab, 0.5, 99))
            order = [n for k in range(a.rounds) for n in (list(urls) if k % 2 == 0 else list(urls)[::-1])]
            for k, name in enumerate(order):
                spies = []
                if a.py_spy and name == "flame door" and not spy:
                    spy_pids = {n: p for n, p in pids[name].items() if n != "router"}
                    spies = py_spy(spy_pids, min(a.py_spy, a.duration_s), os.path.join(a.logs, "py-spy"))
                row = measure(name, urls[name], pids[name], a, vocab, seed=k, engine=engine[name],
                              shard_stats=stats[name])
                row["round"] = k // 2
                rows.append(row)
                for proc in spies:
                    proc.wait(timeout=60)
                if spies:
                    spy = {n: top_functions(os.path.join(a.logs, "py-spy", f"{n.replace(' ', '-')}.txt"))
                           for n in spy_pids}
        finally:
            flame.stop()
            http.stop()
    print(table(rows))
    for n, t in spy.items():
        print(f"\n{n}: {t['samples']} samples; own %: {t['own_pct'][:12]}\ninclusive %: {t['inclusive_pct'][:20]}")
    write_json(a.out, {"args": vars(a), "rows": rows, "py_spy": spy})
    return 0


if __name__ == "__main__":
    sys.exit(main())
