"""`flame-llm bench --mode loadgen`: MLPerf Inference's LoadGen (`mlcommons-loadgen`) drives each system in turn
through the Offline, Server and Interactive scenarios of an MLPerf-style llama3.1-8b task. MLPerf-STYLE, NOT AN
MLPERF SUBMISSION: synthetic token ids of the reference's lengths (bench/load/mlperf_data.py), dummy weights, no
accuracy run, short runs (LoadGen's own VALID/INVALID is reported as it says it, against the settings we gave it).

Offline: every sample issued at once; tokens/s. Server: Poisson arrivals at --server-qps, valid when LoadGen says so
(TTFT p99 <= 2 s, TPOT p99 <= 100 ms, early stopping, min duration and queries); Interactive: Server with 0.5 s and
30 ms. --find-qps searches the highest valid Server (or Interactive) target QPS: doubling up from the start
(--server-qps, or half the Offline samples/s when Offline ran first) until a run is invalid, then bisecting, within
--find-qps-max-s seconds of runs. Every LoadGen run's mlperf_log_summary.txt and mlperf_log_detail.txt stay beside
the report: OUT/loadgen/<system>/<run>/, the record per system in OUT/raw/loadgen-<system>.json, OUT/loadgen.{json,md}.

    flame-llm bench --mode loadgen --scenario offline,server --systems flame,vllm --find-qps --out DIR
    flame-llm bench --mode loadgen --scenario interactive --systems flame-http --server-qps 4 --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass

from bench.load.mlperf_data import LATENCY_BOUNDS_S, REFERENCE_SAMPLES, DatasetConfig, make_dataset
from bench.load.mlperf_report import LOADGEN_FORMAT, NOTE, parse_summary, write_report
from bench.load.mlperf_sut import LoadgenSut, make_backend, parse_sut

log = logging.getLogger(__name__)
SCENARIOS = ("offline", "server", "interactive")
# mlperf.conf's seeds (*.*.qsl_rng_seed, sample_index_rng_seed, schedule_rng_seed)
SEEDS = (1780908523862526354, 14771362308971278857, 18209322760996052031)


@dataclass(slots=True)
class LoadgenConfig:
    scenarios: tuple[str, ...] = ("offline",)
    server_qps: float = 1.0  # Server / Interactive target QPS (find-qps: where the search starts, unless Offline ran)
    find_qps: bool = False
    find_qps_max_s: float = 600.0  # seconds of Server runs the search may spend
    duration_s: float = 60.0  # a Server run's min_duration
    min_queries: int = 500  # a Server run's min_query_count (early stopping passes p99 from ~460 queries in bound)
    samples: int = REFERENCE_SAMPLES
    len_scale: float = 1.0

    def __post_init__(self) -> None:
        bad = [s for s in self.scenarios if s not in SCENARIOS]
        if bad or not self.scenarios:
            raise ValueError(
                f"--scenario must be a comma-separated subset of {', '.join(SCENARIOS)}; got "
                f"{','.join(self.scenarios)!r}"
            )
        for flag, v, ok in (
            ("--server-qps", self.server_qps, self.server_qps > 0),
            ("--find-qps-max-s", self.find_qps_max_s, self.find_qps_max_s > 0),
            ("--mlperf-duration-s", self.duration_s, self.duration_s >= 0),
            ("--mlperf-min-queries", self.min_queries, self.min_queries >= 1),
        ):
            if not ok:
                raise ValueError(f"{flag} must be > 0 (min-queries >= 1, duration >= 0); got {v}")


@dataclass(slots=True)
class QpsSearch:
    start: float
    factor: float = 2.0
    rel_tol: float = 0.05  # stop when the bracket (lo, hi) is within 5% of hi
    max_trials: int = 10
    min_qps: float = 0.01


def next_qps(trials: list[tuple[float, bool]], s: QpsSearch) -> float | None:
    """The next target QPS given the (qps, valid) runs so far, or None when the search is done."""
    if not trials:
        return s.start
    if len(trials) >= s.max_trials:
        return None
    good = [q for q, v in trials if v]
    bad = [q for q, v in trials if not v]
    if not bad:
        return max(good) * s.factor
    if not good:
        q = min(bad) / s.factor
        return q if q >= s.min_qps else None
    lo = max(good)
    above = [b for b in bad if b > lo]
    if not above:  # every invalid run lies below a valid one (noise): the highest valid stands
        return None
    hi = min(above)
    return None if (hi - lo) / hi <= s.rel_tol else (lo + hi) / 2


def highest_valid(trials: list[tuple[float, bool]]) -> float | None:
    return max((q for q, v in trials if v), default=None)


def test_settings(lg, scenario: str, cfg: LoadgenConfig, n: int, qps: float):
    ts = lg.TestSettings()
    ts.mode = lg.TestMode.PerformanceOnly
    ts.use_token_latencies = True
    ts.qsl_rng_seed, ts.sample_index_rng_seed, ts.schedule_rng_seed = SEEDS
    if scenario == "offline":
        ts.scenario = lg.TestScenario.Offline
        ts.offline_expected_qps = 1.0  # with min_duration 0: exactly min_query_count samples, every one once
        ts.min_duration_ms, ts.min_query_count = 0, n
        ts.ttft_latency, ts.tpot_latency = (int(b * 1e9) for b in LATENCY_BOUNDS_S["server"])
    else:
        ts.scenario = lg.TestScenario.Server
        ts.server_target_qps = qps
        ts.min_duration_ms, ts.min_query_count = int(cfg.duration_s * 1000), cfg.min_queries
        ts.ttft_latency, ts.tpot_latency = (int(b * 1e9) for b in LATENCY_BOUNDS_S[scenario])
    return ts


def run_scenario(sut: LoadgenSut, scenario: str, cfg: LoadgenConfig, qps: float, out_dir: str) -> dict:
    """One LoadGen run; its logs in out_dir; the parsed summary with our own counters."""
    lg = sut.lg
    os.makedirs(out_dir, exist_ok=True)
    lo = lg.LogOutputSettings()
    lo.outdir, lo.copy_summary_to_stdout = out_dir, False
    ls = lg.LogSettings()
    ls.log_output, ls.enable_trace = lo, False
    sut.reset()
    t0 = time.perf_counter()
    lg.StartTestWithLogSettings(sut.sut, sut.qsl, test_settings(lg, scenario, cfg, len(sut.dataset), qps), ls)
    wall = time.perf_counter() - t0
    with open(os.path.join(out_dir, "mlperf_log_summary.txt")) as f:
        rec = parse_summary(f.read())
    c = sut.counters()
    if c["failed"]:  # LoadGen counts a failed sample as done: ours is then not a valid run whatever it says
        rec["valid"] = False
    rec.update(
        scenario_name=scenario, target_qps=None if scenario == "offline" else qps, wall_s=wall, counters=c, logs=out_dir
    )
    log.info(
        "%s %s: %s",
        scenario,
        "" if scenario == "offline" else f"at {qps:.3g} qps",
        {k: rec[k] for k in ("result", "samples_per_s", "tokens_per_s", "ttft_p99_s", "tpot_p99_s")},
    )
    return rec


def run_system(label: str, o, cfg: LoadgenConfig, out: str) -> dict:
    from bench.burst.runner import build_setup, model_dir
    from bench.provenance import commit, machine_info
    from bench.systems import make_system

    system, transport = parse_sut(label, o.policy)
    with open(os.path.join(model_dir(o), "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    data = make_dataset(DatasetConfig(samples=cfg.samples, len_scale=cfg.len_scale, vocab_size=vocab, seed=o.seed))
    setup = build_setup(o, os.path.join(out, "logs"))
    sysm = make_system(system, setup, f"loadgen-{label}")
    t0 = time.perf_counter()
    rec = {
        "format": LOADGEN_FORMAT,
        "note": NOTE,
        "system": label,
        "transport": transport,
        "config": asdict(cfg),
        "dataset": data.stats(),
        "runs": [],
        "provenance": {"machine": machine_info(), "commit": commit()},
    }
    sut = None
    try:
        rec["start"] = {k: v for k, v in sysm.start().items() if k != "health"}
        sut = LoadgenSut(make_backend(sysm, transport, setup.burst_timeout_s), data)
        rec["startup_s"] = time.perf_counter() - t0
        rec["warmup_s"] = sut.warmup()
        for scenario in cfg.scenarios:
            base = os.path.join(out, "loadgen", label)
            if scenario == "offline":
                rec["runs"].append(run_scenario(sut, scenario, cfg, 0.0, os.path.join(base, "offline")))
                continue
            if not cfg.find_qps:
                rec["runs"].append(
                    run_scenario(
                        sut, scenario, cfg, cfg.server_qps, os.path.join(base, f"{scenario}-{cfg.server_qps:g}qps")
                    )
                )
                continue
            rec.setdefault("find_qps", {})[scenario] = find_qps(sut, scenario, cfg, rec["runs"], base)
    finally:
        if sut is not None:
            sut.close()
        sysm.stop()
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    with open(os.path.join(out, "raw", f"loadgen-{label}.json"), "w") as f:
        json.dump(rec, f, indent=1)
    return rec


def find_qps(sut: LoadgenSut, scenario: str, cfg: LoadgenConfig, runs: list[dict], base: str) -> dict:
    """Bisect the highest valid target QPS of `scenario`; each run is appended to `runs`."""
    offline = [r for r in runs if r["scenario_name"] == "offline" and r["samples_per_s"]]
    start = offline[-1]["samples_per_s"] / 2 if offline else cfg.server_qps
    search, trials, t0, last_s = QpsSearch(start=start), [], time.perf_counter(), 0.0
    while (qps := next_qps(trials, search)) is not None:
        if time.perf_counter() - t0 + last_s > cfg.find_qps_max_s:
            log.info("%s: find-qps stops, its %.0f s are spent", scenario, cfg.find_qps_max_s)
            break
        t = time.perf_counter()
        r = run_scenario(sut, scenario, cfg, qps, os.path.join(base, f"{scenario}-{qps:.4g}qps"))
        last_s = time.perf_counter() - t
        runs.append(r)
        trials.append((qps, r["valid"]))
    return {
        "start_qps": start,
        "trials": trials,
        "highest_valid_qps": highest_valid(trials),
        "search": asdict(search),
        "spent_s": time.perf_counter() - t0,
    }


_C = LoadgenConfig()
# (flags, add_argument kwargs): the `flame-llm bench --mode loadgen` options
LOADGEN_ARGUMENTS = [
    (
        ("--scenario",),
        {
            "default": ",".join(_C.scenarios),
            "help": "loadgen mode: comma-separated offline, server, "
            "interactive (Server with TTFT 0.5 s / TPOT 30 ms), run in that order per system",
        },
    ),
    (
        ("--server-qps",),
        {
            "type": float,
            "default": _C.server_qps,
            "help": "loadgen mode: Server/Interactive target "
            "QPS (--find-qps: the search's start unless Offline ran first)",
        },
    ),
    (("--find-qps",), {"action": "store_true", "help": "loadgen mode: search the highest valid Server QPS"}),
    (
        ("--find-qps-max-s",),
        {
            "type": float,
            "default": _C.find_qps_max_s,
            "help": "loadgen mode: seconds of runs the QPS search may spend per scenario",
        },
    ),
    (
        ("--mlperf-samples",),
        {
            "type": int,
            "default": _C.samples,
            "help": "loadgen mode: dataset samples (Offline issues each once; the reference has 13,368)",
        },
    ),
    (
        ("--mlperf-len-scale",),
        {
            "type": float,
            "default": _C.len_scale,
            "help": "loadgen mode: input and output lengths x this, in (0, 1] (CPU: the same shape, less work)",
        },
    ),
    (
        ("--mlperf-duration-s",),
        {
            "type": float,
            "default": _C.duration_s,
            "help": "loadgen mode: a Server run's min duration (MLPerf's is 600)",
        },
    ),
    (
        ("--mlperf-min-queries",),
        {"type": int, "default": _C.min_queries, "help": "loadgen mode: a Server run's min query count"},
    ),
]


def run_loadgen(a: argparse.Namespace) -> int:
    """The loadgen mode of `flame-llm bench` (bench/burst/pairs.py): every system in turn, then the report."""
    from bench.burst.runner import local_ray_scope, options_from_args

    try:
        import mlperf_loadgen  # noqa: F401
    except ImportError:
        raise SystemExit(
            "--mode loadgen needs MLPerf LoadGen: pip install mlcommons-loadgen==6.0.17 (the 'test' extra)"
        ) from None
    o = options_from_args(a)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    try:
        cfg = LoadgenConfig(
            scenarios=tuple(s.strip() for s in a.scenario.split(",") if s.strip()),
            server_qps=a.server_qps,
            find_qps=a.find_qps,
            find_qps_max_s=a.find_qps_max_s,
            duration_s=a.mlperf_duration_s,
            min_queries=a.mlperf_min_queries,
            samples=a.mlperf_samples,
            len_scale=a.mlperf_len_scale,
        )
        for s in systems:
            parse_sut(s, o.policy)
        need = DatasetConfig(samples=cfg.samples, len_scale=cfg.len_scale).max_total_tokens()
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if need > o.max_model_len:
        raise SystemExit(
            f"--max-model-len {o.max_model_len} cannot hold the longest sample ({need} tokens: prompt + "
            f"answer); raise it, or lower --mlperf-len-scale"
        )
    if len(set(systems)) != len(systems) or not systems:
        raise SystemExit(f"--systems must list distinct systems; got {a.systems!r}")
    os.makedirs(o.out, exist_ok=True)
    with local_ray_scope():
        recs = [run_system(label, o, cfg, o.out) for label in systems]
    print(write_report(o.out))
    failed = [r["system"] for r in recs if any(x["counters"]["failed"] for x in r["runs"])]
    return 1 if failed else 0
