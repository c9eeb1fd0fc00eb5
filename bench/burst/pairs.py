"""Two modes. burst (default): fresh interleaved pairs: for each trace, `--pairs` pairs; inside pair p the
systems run one after the other, each started fresh, in an order rotated by p (A B, B A, ...). Then the
paired report. load: each system fresh in turn under a Poisson stream of the document-QA mix at each of
`--rates` for `--duration-s` (bench/load/mode.py), then the load report (latency against offered load).

    ray job submit --working-dir . -- python -m bench.burst.pairs --systems flame,engine --pairs 5 --out DIR
    flame-llm bench --systems flame,engine --pairs 5 --out DIR        (the same, without a job)
    flame-llm bench --mode load --systems flame,engine,vllm --rates 0.5,1,2,4 --duration-s 60 --out DIR
    flame-llm bench --mode loadgen --scenario offline,server --systems flame,vllm --find-qps --out DIR
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
import sys
from dataclasses import asdict

from tqdm import tqdm

from bench.burst.report import render_markdown, write_report
from bench.burst.runner import RUN_ARGUMENTS, check_round_robin, local_ray_scope, options_from_args, run_one
from bench.burst.traces import BURST_TRACES, TRACE_NAMES
from bench.load.mlperf import LOADGEN_ARGUMENTS
from bench.load.mode import LOAD_ARGUMENTS
from bench.provenance import call_info, machine_info
from bench.system_config import parse_system

log = logging.getLogger(__name__)


# (flags, add_argument kwargs): the `flame-llm bench` options
ARGUMENTS = [
    (("--mode",), {"default": "burst", "choices": ("burst", "load", "loadgen"),
                   "help": "burst: the paired burst report; load: sustained Poisson load at each of --rates; "
                           "loadgen: MLPerf LoadGen's scenarios, MLPerf-style (bench/load/mlperf.py)"}),
    (("--systems",), {"default": "flame,engine", "help": "comma-separated labels: flame, engine, vllm, vllm-seed, "
                      "each optionally -rr; the first is the subject of the report's ratios (loadgen mode also: "
                      "flame-http, the front door)"}),
    (("--traces",), {"default": ",".join(TRACE_NAMES), "help": "comma-separated: no-reuse, reuse (the seed's), decode "
                      "(issue 39: long drawn answers, --decode-*)"}),
    (("--pairs",), {"type": int, "default": 5, "help": "interleaved pairs per trace (the report warns below "
                    "3: no spread to judge)"}),
    (("--pair-start",), {"type": int, "default": 0, "help": "index of the first pair (to split the pairs of one "
                         "report over several commands writing to the same --out)"}),
    *RUN_ARGUMENTS,
    *LOAD_ARGUMENTS,
    *LOADGEN_ARGUMENTS,
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flags, kwargs in ARGUMENTS:
        p.add_argument(*flags, **kwargs)


def run(a: argparse.Namespace) -> int:
    if a.mode == "load":
        return run_load(a)
    if a.mode == "loadgen":
        from bench.load.mlperf import run_loadgen
        return run_loadgen(a)
    o = options_from_args(a)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    traces = [t.strip() for t in a.traces.split(",") if t.strip()]
    for s in systems:
        parse_system(s, o.policy)  # a bad label fails before anything starts
    check_round_robin(systems, o)
    bad = [t for t in traces if t not in BURST_TRACES]
    if bad or not traces:
        raise SystemExit(f"--traces must be a comma-separated subset of {BURST_TRACES}; got {a.traces!r}")
    if len(set(systems)) != len(systems) or len(systems) < 1:
        raise SystemExit(f"--systems must list distinct systems; got {a.systems!r}")
    if a.pairs < 1 or a.pair_start < 0:
        raise SystemExit(f"--pairs must be >= 1 and --pair-start >= 0; got {a.pairs}, {a.pair_start}")
    pairs = range(a.pair_start, a.pair_start + a.pairs)
    check_pairs_free(o.out, traces, pairs)
    call = call_info(a.pair_start, a.pairs, sys.argv)
    os.makedirs(os.path.join(o.out, "calls"), exist_ok=True)
    meta = {"systems": systems, "traces": traces, "pairs": a.pairs, "pair_start": a.pair_start, "argv": sys.argv,
            "started_at": dt.datetime.now(dt.timezone.utc).isoformat(), "options": asdict(o), "call": call,
            "machine": machine_info()}
    for path in (os.path.join(o.out, "bench.json"), os.path.join(o.out, "calls", f"{call['id']}.json")):
        with open(path, "w") as f:  # bench.json: the latest call (the report's system order); calls/: every call
            json.dump(meta, f, indent=1)
    n = len(systems)
    plan = [(t, p, pos, systems[(p + pos) % n]) for t in traces for p in pairs for pos in range(n)]
    failed = []
    with local_ray_scope(), tqdm(plan, desc="runs", unit="run") as bar:
        for t, p, pos, label in bar:
            bar.set_postfix_str(f"{t} pair {p} {label}")
            raw = run_one(o, label, t, p, pos, call)
            if not raw["checks"]["ok"]:
                failed.append(raw["path"])
                log.error("%s: checks failed: %s %s", raw["path"], raw["error"] or "", raw["checks"]["failures"])
    rep = write_report(o.out, None, systems)
    print(render_markdown(rep, o.out))
    if failed:
        print(f"{len(failed)} run(s) failed their checks: {failed}", file=sys.stderr)
    return 1 if failed else 0


def check_pairs_free(out: str, traces: list[str], pairs: range) -> None:
    """Refuse, before anything starts, to reuse a pair index already under `out` for one of these traces, whatever
    its systems: the report merges every record there and forms pair p of a trace from its runs, so a pair index
    belongs to one call (a continuation into the same --out starts past every pair there)."""
    done = {(t, s): sorted(int(m[1]) for f in os.listdir(os.path.join(out, "raw", t, s))
                           if (m := re.fullmatch(r"pair(\d+)\.json", f)))
            for t in traces if os.path.isdir(os.path.join(out, "raw", t))
            for s in sorted(os.listdir(os.path.join(out, "raw", t))) if os.path.isdir(os.path.join(out, "raw", t, s))}
    taken = [f"raw/{t}/{s}/pair{p:02d}.json" for (t, s), ps in done.items() for p in ps if p in pairs]
    if taken:
        nxt = 1 + max(p for ps in done.values() for p in ps)
        raise SystemExit(f"--out {out} already holds {taken[0]} ({len(taken)} run(s) of pairs {pairs.start}-"
                         f"{pairs.stop - 1} there); continue with --pair-start {nxt}, or use another --out")


def run_load(a: argparse.Namespace) -> int:
    from bench.load.mode import run_load
    return run_load(a)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flame-llm bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
