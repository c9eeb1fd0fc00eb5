"""`flame-llm bench --mode load`: each system started fresh (the time from its start to the first answered
request recorded), a warmup stream, then one window per rate of the document-QA Poisson stream
(bench/load/loadgen.py), then stopped; one raw JSON per system, and the report (bench/load/load_report.py).

Rates are a fixed list, or `--rates auto`: doubling from --auto-start-rps until a window saturates (achieved <
sat_fraction x arrivals) or misses the SLO target, then bisecting between the last good and the first bad rate
(--auto-bisect windows), within --auto-max-windows windows and --auto-max-s seconds of windows. Around every
window the engines' JIT-compile and GC-pause counters and this process's GC pauses are read (bench/load/load_stalls.py).
`--kill-shard-at S` (flame only) kills shard 0's engine actor (Ray restarts it) S seconds into each window.

    flame-llm bench --mode load --systems flame,engine,vllm --rates 0.5,1,2,4 --duration-s 60 --out DIR
    flame-llm bench --mode load --systems flame,vllm --rates auto --duration-s 30 --out DIR
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import time

import numpy as np

from bench.burst.runner import build_setup, check_round_robin
from bench.http_client import SERVED_MODEL_NAME
from bench.load.load_report import LOAD_FORMATS, load_records, render, write_load_report  # noqa: F401 - re-exported
from bench.load.load_stalls import (
    GcWatch,
    cache_counters,
    kv_capacity_tokens,
    stall_counters,
    stream_resumes,
    window_cache,
    window_stalls,
)
from bench.load.loadgen import LOAD_FORMAT, LoadConfig, Outcome, make_documents, run_rate, stream_one, summarize
from bench.load.loadgen import record as load_record
from bench.provenance import commit, machine_info, source_digest
from bench.system_config import parse_system
from bench.systems import make_system
from flame_llm.config import CacheConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class AutoSearch:
    """`--rates auto`: where to start, how far to go."""
    start_rps: float = 1.0
    factor: float = 2.0
    bisect: int = 3  # windows after the first bad one (halving the bracket each)
    max_windows: int = 10
    max_s: float = 1800.0  # seconds of windows (arrivals + drain) the search may spend
    max_rps: float = 4096.0

    def __post_init__(self) -> None:
        for name, ok in (("start_rps", self.start_rps > 0), ("factor", self.factor > 1), ("bisect", self.bisect >= 0),
                         ("max_windows", self.max_windows >= 1), ("max_s", self.max_s > 0),
                         ("max_rps", self.max_rps >= self.start_rps)):
            if not ok:
                raise ValueError(f"auto search field {name!r} is out of range: {getattr(self, name)!r}")


def breaks(w: dict, cfg: LoadConfig) -> bool:
    """A window past the knee: saturated, or fewer than slo_target_pct % of its requests met the SLO."""
    return w["saturated"] or w["slo_met_pct"] < cfg.slo_target_pct


def next_rate(windows: list[dict], auto: AutoSearch, cfg: LoadConfig) -> float | None:
    """The auto search's next offered rate given the windows so far (in run order), or None when it is done."""
    if not windows:
        return auto.start_rps
    if len(windows) >= auto.max_windows:
        return None
    bad = [w["offered_rps"] for w in windows if breaks(w, cfg)]
    good = [w["offered_rps"] for w in windows if not breaks(w, cfg)]
    if not bad:
        r = max(good) * auto.factor
        return r if r <= auto.max_rps else None
    first_bad = next(i for i, w in enumerate(windows) if breaks(w, cfg))
    if len(windows) - 1 - first_bad >= auto.bisect:
        return None
    hi = min(bad)
    lo = max((g for g in good if g < hi), default=None)
    return hi / auto.factor if lo is None else (lo + hi) / 2


def load_config(a, vocab_size: int) -> LoadConfig:
    auto = a.rates.strip() == "auto"
    rates = (a.auto_start_rps,) if auto else tuple(float(r) for r in a.rates.split(",") if r.strip())
    return LoadConfig(rates=rates, duration_s=a.duration_s, drain_s=a.drain_s, num_docs=a.docs,
                      doc_tokens=a.doc_tokens, question_tokens=a.question_tokens, output_tokens=a.output_tokens,
                      vocab_size=vocab_size, seed=a.seed, slo_ttft_s=a.slo_ttft_s, slo_tpot_s=a.slo_tpot_s,
                      output_len=a.output_len, doc_zipf=a.doc_zipf, slo_target_pct=a.slo_target_pct,
                      kill_shard_at_s=a.kill_shard_at)


def first_answer(replicas, cfg: LoadConfig, t0: float) -> float:
    """Seconds from t0 (the system's start) until a one-token request is answered (retried until it is)."""
    prompt = np.random.default_rng(cfg.seed + 2).integers(0, cfg.vocab_size, cfg.question_tokens).tolist()

    async def once() -> Outcome:
        import aiohttp
        async with aiohttp.ClientSession() as session:
            out = Outcome(0.0, -1, 0)
            await stream_one(session, replicas[0].url, prompt, 1, out, time.perf_counter(), SERVED_MODEL_NAME)
            return out

    while True:
        out = asyncio.run(once())
        if out.error is None:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > 3600:
            raise RuntimeError(f"no answered request within an hour of the start: {out.error}")
        time.sleep(0.1)


def kill_shard(system, shard: int = 0, timeout_s: float = 900.0) -> dict:
    """Kill flame's engine actor of `shard` (Ray restarts it: no_restart=False); wait until it answers again."""
    import ray

    actor = system.service.actors[shard]
    old = ray.get(actor.health.remote(), timeout=30).incarnation
    t0 = time.perf_counter()
    ray.kill(actor, no_restart=False)
    while time.perf_counter() - t0 < timeout_s:
        try:
            if ray.get(actor.health.remote(), timeout=5).incarnation != old:
                return {"shard": shard, "restarted": True, "recovery_s": time.perf_counter() - t0}
        except Exception:  # noqa: BLE001 - dead or restarting: ask again
            pass
        time.sleep(0.05)
    return {"shard": shard, "restarted": False, "recovery_s": None}


def run_window(system, replicas, cfg: LoadConfig, rate: float, docs, revision: str, k: int) -> tuple[dict, list]:
    """One measured window with what could stall it read around it, and the shard kill when asked for."""
    kill: dict = {}
    event = None
    if cfg.kill_shard_at_s is not None:
        def fire() -> None:
            kill.update(kill_shard(system))
        event = (cfg.kill_shard_at_s, fire, kill)
    before, cache = stall_counters(system), cache_counters(system)
    resumes = stream_resumes(system) if event is not None else None
    with GcWatch() as gcw:
        got = asyncio.run(run_rate(replicas, cfg, rate, docs, revision, window_seed=k, event=event))
    w = summarize(got, rate, cfg)
    w["stalls"] = window_stalls(before, stall_counters(system), gcw.figures())
    w["cache"] = window_cache(cache, cache_counters(system))
    if event is not None:
        from bench.load.load_workloads import kill_effect
        w["kill"] = kill_effect(got, kill)
        after = stream_resumes(system)
        w["kill"]["resumed"] = after - resumes if after is not None and resumes is not None else None
    return w, got


def mark_window(label: str, rate: float) -> None:
    """Write "label rate" to $LOAD_WINDOW_MARK (when set) as a window starts: a profiler beside the load
    (bench/service/spy_load.sh) samples the window, not the start-up or the warm-up."""
    path = os.environ.get("LOAD_WINDOW_MARK")
    if path:
        with open(path, "w") as f:
            f.write(f"{label} {rate:g}\n")


def run_system(label: str, o, cfg: LoadConfig, out_dir: str, warmup_requests: int,
               auto: AutoSearch | None = None) -> dict:
    """Start the system fresh, warm it up, run every rate's window (or the auto search), stop it; the raw record
    (also written)."""
    setup = build_setup(o, os.path.join(out_dir, "logs"))
    parsed = parse_system(label, o.policy)
    if cfg.kill_shard_at_s is not None and parsed.kind != "flame":
        raise ValueError(f"--kill-shard-at kills a flame engine actor; system {label!r} is not flame")
    cfg = dataclasses.replace(cfg, policy=parsed.policy)  # the client's placement: "-rr" labels round-robin
    system = make_system(parsed, setup, f"load-{label}")
    t0 = time.perf_counter()
    info = system.start()
    started = time.perf_counter() - t0
    windows, outcomes = [], []
    try:
        replicas = system.http_replicas()
        startup = {"start_s": started, "first_answer_s": first_answer(replicas, cfg, t0)}
        log.info("%s: started in %.1f s, first answer at %.1f s", label, started, startup["first_answer_s"])
        docs = make_documents(cfg)
        block = setup.engine.get("block_size", CacheConfig().block_size)
        cap = kv_capacity_tokens(system, block)
        blocks = setup.engine.get("num_kvcache_blocks", -1)
        if cap is None and blocks > 0:  # serve-http does not publish it; a fixed block count says it
            cap = blocks * block * len(setup.devices)
        kv = {"kv_capacity_tokens": cap, "distinct_doc_tokens": docs.size}
        warm = dataclasses.replace(cfg, rates=(cfg.rates[0],), duration_s=max(1.0, warmup_requests / cfg.rates[0]),
                                   seed=cfg.seed + 1, kill_shard_at_s=None)
        if warmup_requests:  # other documents (seed + 1): the measured windows' prefixes stay unseen
            asyncio.run(run_rate(replicas, warm, warm.rates[0], make_documents(warm), setup.model_revision))
        t_search = time.perf_counter()
        k = 0
        while True:
            if auto is None:
                rate = cfg.rates[k] if k < len(cfg.rates) else None
            else:
                rate = next_rate(windows, auto, cfg)
                if rate is not None and time.perf_counter() - t_search + cfg.duration_s > auto.max_s:
                    log.info("%s: the auto search's %.0f s are spent", label, auto.max_s)
                    rate = None
            if rate is None:
                break
            mark_window(label, rate)
            w, got = run_window(system, replicas, cfg, rate, docs, setup.model_revision, k)
            windows.append(w)
            outcomes.append(got)
            k += 1
            log.info("%s at %.2f req/s: %s", label, rate, {x: w[x] for x in ("achieved_rps", "arrival_rps",
                                                                             "saturated", "slo_met_pct")})
    finally:
        system.stop()
    if auto is not None:
        cfg = dataclasses.replace(cfg, rates=tuple(w["offered_rps"] for w in windows))
    rec = load_record(label, cfg, windows, outcomes, {k: v for k, v in info.items() if k != "health"})
    rec.update(startup=startup, kv=kv, auto=dataclasses.asdict(auto) if auto else None,
               provenance={"machine": machine_info(), "commit": commit(), "source_digest": source_digest()})
    os.makedirs(os.path.join(out_dir, "raw"), exist_ok=True)
    with open(os.path.join(out_dir, "raw", f"load-{label}.json"), "w") as f:
        json.dump(rec, f)
    return rec


_L = LoadConfig()
_A = AutoSearch()
# (flags, add_argument kwargs): the `flame-llm bench --mode load` options
LOAD_ARGUMENTS = [
    (("--rates",), {"default": ",".join(f"{r:g}" for r in _L.rates),
                    "help": "load mode: offered requests per second, comma-separated, or 'auto' (search the knee)"}),
    (("--duration-s",), {"type": float, "default": _L.duration_s, "help": "load mode: seconds of each rate's window"}),
    (("--drain-s",), {"type": float, "default": _L.drain_s,
                      "help": "load mode: wait for running requests after a window"}),
    (("--warmup-requests",), {"type": int, "default": 8, "help": "load mode: requests on other documents first"}),
    (("--slo-ttft-s",), {"type": float, "default": _L.slo_ttft_s,
                         "help": "load mode: goodput's time-to-first-token bound"}),
    (("--slo-tpot-s",), {"type": float, "default": _L.slo_tpot_s,
                         "help": "load mode: goodput's time-per-output-token bound"}),
    (("--slo-target-pct",), {"type": float, "default": _L.slo_target_pct,
                             "help": "load mode, --rates auto: a window breaks below this %% of requests in SLO"}),
    (("--auto-start-rps",), {"type": float, "default": _A.start_rps, "help": "--rates auto: the first rate"}),
    (("--auto-bisect",), {"type": int, "default": _A.bisect, "help": "--rates auto: windows bisecting the knee"}),
    (("--auto-max-windows",), {"type": int, "default": _A.max_windows, "help": "--rates auto: at most this many"}),
    (("--auto-max-s",), {"type": float, "default": _A.max_s, "help": "--rates auto: seconds of windows at most"}),
    (("--output-len",), {"default": _L.output_len, "help": "load mode: answer lengths (seeded): qa (lognormal "
                         "32-512, median 128), long (lognormal 64-1024), N, uniform:LO-HI, lognormal:LO-HI, or fixed "
                         "(--output-tokens each)"}),
    (("--doc-zipf",), {"type": float, "default": _L.doc_zipf,
                       "help": "load mode: document popularity Zipf exponent (0: uniform; hot prefixes)"}),
    (("--kill-shard-at",), {"type": float, "default": None,
                            "help": "load mode, flame only: kill shard 0's engine actor this many seconds into "
                                    "each window (Ray restarts it)"}),
]


def run_load(a: argparse.Namespace) -> int:
    """The load mode of `flame-llm bench` (bench/burst/pairs.py): every system in turn, then the report."""
    from bench.burst.runner import local_ray_scope, model_dir, options_from_args

    o = options_from_args(a)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    for s in systems:
        parse_system(s, o.policy)
    check_round_robin(systems, o)
    with open(os.path.join(model_dir(o), "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    try:
        cfg = load_config(a, vocab)
        auto = AutoSearch(a.auto_start_rps, bisect=a.auto_bisect, max_windows=a.auto_max_windows,
                          max_s=a.auto_max_s) if a.rates.strip() == "auto" else None
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if cfg.kill_shard_at_s is not None and any(parse_system(s, o.policy).kind != "flame" for s in systems):
        raise SystemExit("--kill-shard-at kills a flame engine actor: --systems must be flame systems only")
    os.makedirs(o.out, exist_ok=True)
    with local_ray_scope():
        records = [run_system(label, o, cfg, o.out, a.warmup_requests, auto) for label in systems]
    print(write_load_report(o.out, records))
    failed = [r["system"] for r in records if not any(w["completed"] for w in r["windows"])]
    return 1 if failed else 0


assert LOAD_FORMAT in LOAD_FORMATS
