"""Issue 42 on real Ray, CPU: what a router's view of the shards' load buys. Two shards of the tiny model, policy
'events'; routed requests (unseen prefixes, Poisson arrivals, streamed) go through either the service's router on
load_view 'engines' (the shards' load with their cache events) or a second router, identical but on 'own' (its own
placements). Another client keeps `--outside` long requests in flight on shard 0 through a router of its own, which
the service's routers never see; phases with and without it. Each phase: TTFT p50/p99 (client side: the request's
send to its first token) and the shards the requests went to. Phases run in rounds, the views alternating.

`--step-cost`: what the load feed costs the engine step, microseconds: the engine thread's publish of the
scheduler's sequences (AsyncEngine.sequences: twice per step once asked) and shard_load over them (per read of the
feed, on the actor's control thread), for 16 to 1,024 sequences. `--feed-cost`: the same end to end, one shard's
mean decode step while a thread reads its events 0, 50 or 500 times a second, with the load or without.

    python3 -m bench.service.load_view_ray --out bench/results/2026-12-06-cpu-load-view-ray/ttft.json
    python3 -m bench.service.load_view_ray --step-cost
    python3 -m bench.service.load_view_ray --feed-cost --rounds 4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
import timeit

import numpy as np
import ray

from flame_llm import SamplingParams
from flame_llm.serving.client import Client, make_client
from flame_llm.serving.ray_attach import SHARD_PREFIX
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ServiceConfig
from router.actor import start_router
from router.config import RouterConfig

log = logging.getLogger("bench.service.load_view_ray")
NS = "bench-load-view"
ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 1024, "max_num_seqs": 16, "cpu_kvcache_gib": 0.125,
          "block_size": 128, "enable_kv_events": True}


def _prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 512, n).tolist()


async def _outside(client: Client, n: int, prompt_tokens: int, max_tokens: int, stop: asyncio.Event, seed: int):
    """n workers, each with one long request on the outside client's shard at a time, until stop."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def worker(k: int) -> None:
        rng = np.random.default_rng([7, seed, k])  # not [seed, 0]: numpy pads it to the stream of seed
        while not stop.is_set():
            await client.agenerate([_prompt(rng, prompt_tokens)], sp)
    tasks = [asyncio.create_task(worker(k)) for k in range(n)]
    await stop.wait()
    for t in tasks:
        t.cancel()  # aborts what is left on the shard
    await asyncio.gather(*tasks, return_exceptions=True)


async def _routed(client: Client, n: int, rate: float, prompt_tokens: int, max_tokens: int, seed: int) -> list:
    """n streamed requests with unseen prefixes at Poisson `rate`/s: (ttft_s, shard) each."""
    rng = np.random.default_rng(seed)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(prompt: list[int]) -> tuple[float, int]:
        t0, ttft = time.perf_counter(), None
        async for chunk in client.stream_chunks(prompt, sp):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - t0
            if chunk.result is not None:
                return ttft, chunk.result.shard
        raise AssertionError("a stream ended without its result")
    tasks = []
    for _ in range(n):
        tasks.append(asyncio.create_task(one(_prompt(rng, prompt_tokens))))
        await asyncio.sleep(rng.exponential(1.0 / rate))
    return await asyncio.gather(*tasks)


def _rows(actor) -> int:
    return ray.get(actor.kv_events.remote(0, 0, with_load=True))[-1].load.rows


async def _phase(args, routed: Client, outside: Client | None, actors: dict, seed: int) -> dict:
    stop = asyncio.Event()
    bg = None
    if outside is not None:
        bg = asyncio.create_task(_outside(outside, args.outside, args.prompt_tokens, args.outside_max_tokens, stop,
                                          seed))
        t0 = time.monotonic()  # the outside load is on shard 0 before routed requests start
        while await asyncio.to_thread(_rows, actors[0]) < min(args.outside, ENGINE["max_num_seqs"]):
            assert time.monotonic() - t0 < 60, "the outside load did not start"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
    try:
        got = await _routed(routed, args.requests, args.rate, args.prompt_tokens, args.max_tokens, seed)
    finally:
        stop.set()
        if bg is not None:
            await bg
    t0 = time.monotonic()  # idle shards before the next phase
    while any([await asyncio.to_thread(_rows, a) for a in actors.values()]):
        assert time.monotonic() - t0 < 120, "the shards did not drain"
        await asyncio.sleep(0.05)
    ttft = np.array([t for t, _ in got]) * 1e3
    shards = [s for _, s in got]
    return {"ttft_ms_p50": float(np.percentile(ttft, 50)), "ttft_ms_p99": float(np.percentile(ttft, 99)),
            "ttft_ms_mean": float(ttft.mean()), "n": len(got), "on_shard0": shards.count(0),
            "ttft_ms": [round(float(t), 2) for t in ttft], "shards": shards}


def run(args) -> dict:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = ServiceConfig.from_kwargs(model=args.model, engine=ENGINE, num_shards=2, cpu_per_shard=0.5,
                                    policy="events", load_view="engines", namespace=NS)
    svc = start_service(cfg)
    names = [f"{SHARD_PREFIX}{s}" for s in range(2)]
    own_router = start_router(2, RouterConfig(policy="events"), name="router-own", namespace=NS, shard_names=names)
    out_router = start_router(1, name="router-outside", namespace=NS)
    clients = {"engines": Client.for_service(svc), "own": make_client(cfg, own_router, svc.actors, namespace=NS)}
    outside = make_client(cfg, out_router, {0: svc.actors[0]}, namespace=NS)
    phases = []
    try:
        async def all_phases() -> None:
            warm = SamplingParams(temperature=0.0, max_tokens=4)
            for c in clients.values():
                await c.agenerate([_prompt(np.random.default_rng(99), args.prompt_tokens)] * 2, warm)
            for rnd in range(args.rounds):
                for with_outside in (True, False):
                    views = ("own", "engines") if rnd % 2 == 0 else ("engines", "own")
                    for view in views:
                        seed = 1000 * rnd + 10 * with_outside + (view == "engines")
                        res = await _phase(args, clients[view], outside if with_outside else None, svc.actors, seed)
                        res.update(round=rnd, view=view, outside=args.outside if with_outside else 0)
                        log.info("%s", {k: v for k, v in res.items() if k not in ("ttft_ms", "shards")})
                        phases.append(res)
        asyncio.run(all_phases())
        stats = {v: ray.get(r.stats.remote()) for v, r in (("engines", svc.router), ("own", own_router))}
    finally:
        for c in (*clients.values(), outside):
            c.close()
        svc.stop(timeout_s=10)
        ray.shutdown()
    summary = {}
    for with_outside in (True, False):
        for view in ("own", "engines"):
            xs = [p for p in phases if p["view"] == view and bool(p["outside"]) == with_outside]
            ttft = np.concatenate([p["ttft_ms"] for p in xs])
            summary[f"{view}/{'outside' if with_outside else 'none'}"] = {
                **{f"ttft_ms_p{q}": float(np.percentile(ttft, q)) for q in (50, 90, 99)},
                "ttft_ms_mean": float(ttft.mean()), "n": int(ttft.size), "on_shard0": sum(p["on_shard0"] for p in xs)}
    return {"args": vars(args), "engine": ENGINE, "summary": summary, "phases": phases,
            "router_counters": {v: {"counters": s["counters"], "event_feed": s.get("event_feed"),
                                    "view": {k: v2 for k, v2 in s.get("view", {}).items() if k != "load"}}
                                for v, s in stats.items()}}


def step_cost(model: str) -> dict:
    """The load feed's cost, microseconds (best of 7 repeats of 200 calls): the engine thread's publish of the
    scheduler's sequences (Scheduler.sequences, twice per step once asked), shard_load over them, and a feed read
    with and without the load (KvEventLog.read on a log with nothing new), for N sequences, half running."""
    from flame_llm.config import Config
    from flame_llm.engine.block_manager import BlockManager
    from flame_llm.engine.scheduler import Scheduler
    from flame_llm.engine.sequence import Sequence
    from flame_llm.models.tiny import resolve_model
    from flame_llm.protocol.kv_events import KvEventLog, shard_load

    def best_us(fn) -> float:
        return min(timeit.repeat(fn, number=200, repeat=7)) / 200 * 1e6

    out = {}
    for n in (16, 64, 256, 1024):
        cfg = Config.from_kwargs(resolve_model(model), device="cpu", block_size=16, max_num_seqs=n // 2,
                                 max_num_batched_tokens=256 * n, max_model_len=1024, num_kvcache_blocks=32 * n,
                                 enable_kv_events=True)
        bm = BlockManager(32 * n, 16, enable_kv_events=True)
        sched = Scheduler(cfg, bm)
        rng = np.random.default_rng(n)
        for _ in range(n):
            sched.add(Sequence(rng.integers(3, 512, 256).tolist(), SamplingParams(max_tokens=128), 16))
        sched.schedule()  # half admitted (max_num_seqs), half waiting
        log = KvEventLog(0, bm, sequences=sched.sequences)
        log.read(0, 0)
        seqs = sched.sequences()
        out[n] = {"running": len(sched.running), "publish_us": best_us(sched.sequences),
                  "shard_load_us": best_us(lambda s=seqs: shard_load(s)),
                  "read_us": best_us(lambda lg=log: lg.read(lg.epoch, lg.seq)),
                  "read_with_load_us": best_us(lambda lg=log: lg.read(lg.epoch, lg.seq, with_load=True))}
    return out


def feed_cost(args) -> dict:
    """The load feed's cost on the engine's steps, end to end: one shard decoding a fixed batch (`--outside` requests,
    --outside-max-tokens each) while a thread reads its events at `hz` reads/s (arm "hz", or "hz:noload" without the
    load: what the read itself costs; 0: none; 50 is one router at event_poll_ms 20), arms alternating over --rounds:
    mean decode step (the engine's decode_time_s / steps); the summary has each arm's medians."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = ServiceConfig.from_kwargs(model=args.model, engine=ENGINE, num_shards=1, cpu_per_shard=1.0,
                                    policy="events", namespace=NS)  # load_view 'own': its router reads no load
    svc = start_service(cfg)
    client, actor = Client.for_service(svc), svc.actors[0]
    sp = SamplingParams(temperature=0.0, max_tokens=args.outside_max_tokens, ignore_eos=True)
    rng = np.random.default_rng(5)
    arms: dict[str, list] = {arm: [] for arm in args.poll_hz}
    try:
        client.generate([_prompt(rng, args.prompt_tokens)], SamplingParams(max_tokens=4))
        for _ in range(args.rounds):
            for arm in args.poll_hz:
                hz, with_load = int(arm.split(":")[0]), not arm.endswith(":noload")
                stop, reads = threading.Event(), [0]

                def poll(hz=hz, with_load=with_load, stop=stop, reads=reads) -> None:
                    cur = (0, 0)
                    while not stop.wait(1.0 / hz):
                        bs = ray.get(actor.kv_events.remote(*cur, with_load=with_load))
                        cur = (bs[-1].epoch, bs[-1].seq) if bs else cur
                        reads[0] += 1
                poller = threading.Thread(target=poll, daemon=True) if hz else None
                before = ray.get(actor.stats.remote())["engine"]
                if poller is not None:
                    poller.start()
                t0 = time.perf_counter()
                client.generate([_prompt(rng, args.prompt_tokens) for _ in range(args.outside)], sp)
                wall = time.perf_counter() - t0
                stop.set()
                after = ray.get(actor.stats.remote())["engine"]
                steps = after["num_decode_steps"] - before["num_decode_steps"]
                arms[arm].append({"decode_step_ms": 1e3 * (after["decode_time_s"] - before["decode_time_s"]) / steps,
                                 "wall_s": wall, "reads_per_s": reads[0] / wall})
                log.info("arm %s %s", arm, arms[arm][-1])
    finally:
        client.close()
        svc.stop(timeout_s=10)
        ray.shutdown()
    return {"args": vars(args), "engine": ENGINE, "arms": arms,
            "summary": {arm: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for arm, rs in arms.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=40, help="routed requests per phase")
    ap.add_argument("--rate", type=float, default=4.0, help="routed requests per second (Poisson)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16, help="routed requests' output tokens")
    ap.add_argument("--outside", type=int, default=24, help="another client's requests kept in flight on shard 0")
    ap.add_argument("--outside-max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step-cost", action="store_true", help="only the load feed's cost per engine step")
    ap.add_argument("--feed-cost", action="store_true", help="only the feed's cost on one shard's decode steps")
    ap.add_argument("--poll-hz", nargs="+", default=["0", "50:noload", "50", "500:noload", "500"],
                    help="--feed-cost arms: event reads per second, ':noload' without the load")
    ap.add_argument("--out")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    res = step_cost(args.model) if args.step_cost else feed_cost(args) if args.feed_cost else run(args)
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps(res.get("summary", res), indent=1))


if __name__ == "__main__":
    main()
