"""Soak: sustained streaming through the HTTP front door while every flame process's resident memory (RSS) and open
file descriptors are sampled, then a verdict: flat when each process's median over the run's last window is within
--tolerance (5%) of its median over the window after warm-up (fds: or within FD_SLACK descriptors, as a socket
or two in flight moves a count of ~40 by more than 5%).

The service starts here on a local Ray (the config's shards, router and front door on 127.0.0.1), the processes
sampled are this driver (it also runs the load), the front door, the router and every shard; a process that is
replaced (a restarted shard) is reported and judged not flat. Every request is a streamed completion of random
token ids at --rate per second (open loop; at most --max-concurrency at once), read to [DONE]. Exit 0 when every
request completed and every process is flat, else 1.

  python -m bench.service.soak --config configs/demo.yaml --duration-s 1800 --rate 2 --out bench/results/soak-30min.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import time
from dataclasses import dataclass, field

log = logging.getLogger("bench.service.soak")
FD_SLACK = 4  # descriptors: a count within this of its baseline is flat whatever the percentage


@dataclass(slots=True)
class Proc:
    name: str
    pid: int
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (seconds since start, RSS bytes, fds)
    replaced: bool = False


def read_proc(pid: int) -> tuple[int, int] | None:
    """(RSS bytes, open fds) of a live process from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def flame_pids(door, router, shards: dict) -> dict[str, int]:
    import ray

    def pid_of(handle) -> int:
        return ray.get(handle.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)

    pids = {"driver+load": os.getpid(), "frontdoor": pid_of(door), "router": pid_of(router)}
    pids.update({f"shard-{s}": pid_of(a) for s, a in sorted(shards.items())})
    return pids


def verdict(p: Proc, duration_s: float, warmup_s: float, tolerance: float) -> dict:
    """Baseline: the median over [warmup_s, warmup_s + window]; final: over the last window (window: a tenth of
    the run, at least three samples)."""
    window = max(duration_s / 10, 1e-9)
    base = [s for s in p.samples if warmup_s <= s[0] <= warmup_s + window] or p.samples[:3]
    last = [s for s in p.samples if s[0] >= duration_s - window] or p.samples[-3:]
    out = {"name": p.name, "pid": p.pid, "samples": len(p.samples), "replaced": p.replaced}
    flat = not p.replaced and bool(base) and bool(last)
    for k, what in ((1, "rss"), (2, "fds")):
        b = statistics.median(s[k] for s in base) if base else 0
        f = statistics.median(s[k] for s in last) if last else 0
        growth = (f - b) / b if b else 0.0
        ok = abs(growth) <= tolerance or (what == "fds" and abs(f - b) <= FD_SLACK)
        out.update({f"{what}_base": b, f"{what}_final": f, f"{what}_growth": round(growth, 4), f"{what}_flat": ok})
        flat = flat and ok
    out["flat"] = flat
    return out


async def one_stream(session, url: str, body: dict, stats: dict) -> None:
    t0 = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                stats["failed"] += 1
                stats["errors"].append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return
            done = False
            async for line in resp.content:
                if line.strip() == b"data: [DONE]":
                    done = True
            stats["ok" if done else "failed"] += 1
            stats["latency_s"].append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - counted and reported
        stats["failed"] += 1
        stats["errors"].append(f"{type(e).__name__}: {e}"[:200])


async def run_load(url: str, args, vocab: int, procs: dict[str, Proc]) -> dict:
    import aiohttp

    rng = random.Random(args.seed)
    stats = {"sent": 0, "ok": 0, "failed": 0, "errors": [], "latency_s": []}
    sem = asyncio.Semaphore(args.max_concurrency)
    tasks: set[asyncio.Task] = set()
    t_start = time.monotonic()
    end = t_start + args.duration_s
    total = int(args.rate * args.duration_s)  # bounded in count as in time

    async def sample_loop() -> None:
        while time.monotonic() < end:
            t = time.monotonic() - t_start
            for p in procs.values():
                got = read_proc(p.pid)
                if got is None:
                    p.replaced = True
                    continue
                p.samples.append((t, *got))
            await asyncio.sleep(args.sample_every_s)

    async def send(body: dict) -> None:
        async with sem:
            await one_stream(session, url, body, stats)

    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        sampler = asyncio.create_task(sample_loop())
        for k in range(total):
            await asyncio.sleep(max(0.0, t_start + k / args.rate - time.monotonic()))
            body = {"prompt": [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)],
                    "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True}
            stats["sent"] += 1
            task = asyncio.create_task(send(body))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=args.request_timeout_s)
        await sampler
    lat = sorted(stats.pop("latency_s"))
    stats["latency_p50_s"] = lat[len(lat) // 2] if lat else None
    stats["latency_p99_s"] = lat[int(len(lat) * 0.99)] if lat else None
    stats["errors"] = stats["errors"][:20]
    return stats


def run(args) -> int:
    import ray

    from flame_llm.serving.frontdoor import start_frontdoor, stop_frontdoor
    from flame_llm.serving.http_app import HttpConfig
    from flame_llm.serving.service import start_service
    from flame_llm.serving.service_config import load_service_config

    cfg = load_service_config(args.config, args.namespace)
    ray.init(address="local", num_cpus=cfg.ray.num_cpus, include_dashboard=False, log_to_driver=False)
    svc = start_service(cfg, source=args.config)
    door = None
    try:
        door, url = start_frontdoor(cfg.ray.namespace, HttpConfig(host="127.0.0.1", port=0), client=cfg.client)
        pids = flame_pids(door, svc.router, svc.actors)
        procs = {n: Proc(n, pid) for n, pid in pids.items()}
        log.info("soak: %s for %.0fs at %.2f req/s; processes %s", url, args.duration_s, args.rate, pids)
        load = asyncio.run(run_load(url, args, svc.health[0].limits.vocab_size, procs))
    finally:
        if door is not None:
            stop_frontdoor(cfg.ray.namespace)
            del door
        svc.stop(timeout_s=10)
        ray.shutdown()
    verdicts = [verdict(p, args.duration_s, args.warmup_s, args.tolerance) for p in procs.values()]
    ok = load["failed"] == 0 and load["ok"] == load["sent"] and all(v["flat"] for v in verdicts)
    report = {"config": args.config, "duration_s": args.duration_s, "rate": args.rate, "max_tokens": args.max_tokens,
              "prompt_tokens": args.prompt_tokens, "tolerance": args.tolerance, "warmup_s": args.warmup_s,
              "load": load, "processes": verdicts, "verdict": "flat" if ok else "NOT flat",
              "samples": {p.name: p.samples for p in procs.values()}}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"requests: {load['sent']} sent, {load['ok']} ok, {load['failed']} failed; p50 {load['latency_p50_s']}s")
    print(f"{'process':<12} {'rss MB base->final':>22} {'growth':>8} {'fds':>10} {'growth':>8}  flat")
    for v in verdicts:
        print(f"{v['name']:<12} {v['rss_base'] / 2**20:>10.1f} -> {v['rss_final'] / 2**20:>8.1f} "
              f"{v['rss_growth']:>+8.2%} {v['fds_base']:>4.0f}->{v['fds_final']:<4.0f} {v['fds_growth']:>+8.2%}  "
              f"{'yes' if v['flat'] else 'NO'}{' (replaced)' if v['replaced'] else ''}")
    print(f"verdict: {report['verdict']} (within {args.tolerance:.0%})")
    return 0 if ok else 1


ARGUMENTS = [
    (("--config",), {"default": "configs/demo.yaml", "help": "the service config (a local Ray is started)"}),
    (("--namespace",), {"default": "flame-soak"}),
    (("--duration-s",), {"type": float, "default": 300.0}),
    (("--rate",), {"type": float, "default": 2.0, "help": "streamed requests per second (open loop)"}),
    (("--max-tokens",), {"type": int, "default": 32}),
    (("--prompt-tokens",), {"type": int, "default": 64}),
    (("--max-concurrency",), {"type": int, "default": 64}),
    (("--request-timeout-s",), {"type": float, "default": 120.0}),
    (("--sample-every-s",), {"type": float, "default": 5.0}),
    (("--warmup-s",), {"type": float, "default": 30.0, "help": "the baseline window starts here"}),
    (("--tolerance",), {"type": float, "default": 0.05}),
    (("--seed",), {"type": int, "default": 0}),
    (("--out",), {"default": None, "help": "the report as JSON (every sample included)"}),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.service.soak", description=__doc__.split("\n\n")[0])
    for flags, kwargs in ARGUMENTS:
        p.add_argument(*flags, **kwargs)
    args = p.parse_args(argv)
    if not (args.duration_s > 0 and args.rate > 0 and 0 <= args.warmup_s < args.duration_s):
        p.error("--duration-s and --rate must be > 0 and --warmup-s in [0, duration)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
