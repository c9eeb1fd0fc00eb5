"""The long inter-token gaps of a load record and their neighbours: for each window, the gaps over --long-ms (a
long prefill step every decoding stream waited through) and the median of the gap just before and just after
each in the same stream. Where the ITL p99 falls among them says which step sets it.

    bash bench/records.sh restore bench/results/2026-12-02b-h200-workloads  # raw records: on the results branch
    python -m bench.load.long_gaps bench/results/2026-12-02b-h200-workloads/hot-prefixes/raw/load-*.json
"""
from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from bench.provenance import read_json


def window_gaps(outcomes: list[dict], long_ms: float) -> dict:
    """Long gaps of one window's outcomes (each with chunk_s, one arrival time per chunk) and their neighbours."""
    long, before, after, every = [], [], [], []
    for o in outcomes:
        gaps = np.diff(np.asarray(o.get("chunk_s") or [], dtype=float)) * 1e3
        every.extend(gaps.tolist())
        for i in np.flatnonzero(gaps > long_ms):
            long.append(float(gaps[i]))
            if i > 0:
                before.append(float(gaps[i - 1]))
            if i + 1 < len(gaps):
                after.append(float(gaps[i + 1]))

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None
    return {"gaps": len(every), "itl_p99_ms": float(np.percentile(every, 99)) if every else None,
            "long": len(long), "long_ms_p50": med(long), "before_ms_p50": med(before), "after_ms_p50": med(after),
            "long_share_pct": 100.0 * len(long) / len(every) if every else None}


def record_gaps(rec: dict, long_ms: float) -> list[dict]:
    return [{"offered_rps": w["offered_rps"], **window_gaps(o, long_ms)}
            for w, o in zip(rec["windows"], rec["outcomes"])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load.long_gaps", description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="+", help="load records (load-<system>.json or .json.gz)")
    p.add_argument("--long-ms", type=float, default=100.0)
    a = p.parse_args(argv)

    def f(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f}"
    print(f"| system | offered req/s | gaps | ITL p99 (ms) | gaps > {a.long_ms:g} ms (% of all) | before / long / "
          "after, p50 (ms) |")
    print("|---|---|---|---|---|---|")
    for path in a.records:
        rec = read_json(path)
        for w in record_gaps(rec, a.long_ms):
            print(f"| {rec['system']} | {w['offered_rps']:g} | {w['gaps']} | {f(w['itl_p99_ms'])} | {w['long']} "
                  f"({f(w['long_share_pct'])}) | {f(w['before_ms_p50'])} / {f(w['long_ms_p50'])} / "
                  f"{f(w['after_ms_p50'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
