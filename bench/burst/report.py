"""Paired report from raw run records: `flame-llm report <raw dir>` (or `python -m bench.burst.report`).

Every number comes from the per-request records: a run's throughput is its request count over the latest
completion (seconds from burst release), and its output tokens over the same span (output tok/s: what a
decode-heavy trace measures; for the seed's 16-token answers it is 16 x req/s), cached percentage is cached over
prompt tokens, latencies are the completion times pooled over a system's runs. Runs whose checks failed are
listed and left out of the statistics. The first system is the subject; ratios (of req/s and of output tok/s) are
subject / each other system, per pair and of the medians. Writes report.md, report.json and report.png (the PNG
only when matplotlib is importable).
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import statistics
import sys

import numpy as np

from bench.burst.report_merge import dedupe, pair_provenance, render_provenance
from bench.burst.report_plots import render_png
from bench.burst.runner import RAW_FORMAT
from bench.service.service_path import render as render_service_path
from bench.service.service_path import service_path

log = logging.getLogger(__name__)
PAIR_FLOOR = 0.99  # a pair at or above this ratio counts as "no net overhead" for that pair
# Below these a ratio is not evidence, and the report says so beside it (warnings()):
MIN_PAIRS = 3  # fewer pairs leave no spread to judge: one pair's ratio is one draw of the noise
# A burst carries fixed costs that do not scale with it: measured on the 2-core CPU machine (2026-12-01, 16-request
# reuse bursts of the tiny model), flame's client waits its 10 ms batch formation window and spends ~2.5 ms per
# batch routing, encoding and decoding (2 batches: ~15 ms in all), and one scheduling hiccup of a loaded host is of
# the same size. The paired floor (PAIR_FLOOR) judges 1% differences, so a burst must be >= ~15 ms / 1% = 1.5 s for
# those fixed costs to sit below it: 2 s. Measured spread: 0.07-0.2 s bursts gave paired ratios 0.71-2.69 over 3
# pairs (one system's own req/s over 2.8x); the earlier 0.04-0.18 s bursts (bench/results/2026-11-30-cpu-service-
# path) 0.78-0.87 and 0.97-0.98 on the two traces. Longer bursts remove the fixed costs, not a loaded host's
# noise (1.8-8 s bursts beside five other workloads: 0.33-2.45); the pairs' range shows that, hence MIN_PAIRS.
MIN_BURST_S = 2.0


def load_runs(raw_dir: str) -> list[dict]:
    runs = []
    for path in sorted(glob.glob(os.path.join(raw_dir, "**", "*.json"), recursive=True)):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict) and rec.get("format") == RAW_FORMAT:
            rec["path"] = os.path.relpath(path, raw_dir)
            runs.append(rec)
    if not runs:
        raise ValueError(f"no raw run records ({RAW_FORMAT}) under {raw_dir!r}")
    return dedupe(runs)


def run_summary(run: dict) -> dict:
    reqs = run["requests"]
    burst = max((r["done_s"] for r in reqs), default=0.0)
    prompt = sum(r["prompt_tokens"] for r in reqs)
    out_tokens = sum(r.get("output_len", 0) for r in reqs)
    return {"pair": run["pair"], "position": run["position"], "ok": bool(run["checks"]["ok"]),
            "requests": len(reqs), "burst_s": burst, "req_s": len(reqs) / burst if burst > 0 else 0.0,
            "output_tokens": out_tokens, "out_tok_s": out_tokens / burst if burst > 0 else 0.0,
            "cached_pct": 100.0 * sum(r["cached_tokens"] for r in reqs) / prompt if prompt else 0.0,
            "path": run.get("path"), "failures": run["checks"].get("failures", {}), "error": run.get("error")}


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {}
    a = np.asarray(xs, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def _quantile_points(xs: list[float], n: int = 101) -> list[float]:
    """The 0th..100th percentiles (n points) of xs: enough to draw its CDF, small enough for report.json."""
    return [float(v) for v in np.percentile(np.asarray(xs, dtype=float), np.linspace(0, 100, n))] if xs else []


def system_stats(runs: list[dict]) -> dict:
    both = sorted(((run_summary(r), r) for r in runs), key=lambda x: x[0]["pair"])
    summ = [s for s, _ in both]
    good = [r for s, r in both if s["ok"]]
    rates = [s["req_s"] for s in summ if s["ok"]]
    toks = [s["out_tok_s"] for s in summ if s["ok"]]
    reqs = [q for r in good for q in r["requests"]]
    prompt = sum(q["prompt_tokens"] for q in reqs)
    # durations only: done_at is a clock reading (it feeds each record's done_s instead)
    timing_keys = sorted({k for q in reqs for k, v in q.get("timings", {}).items()
                          if isinstance(v, (int, float)) and k != "done_at"})
    return {
        "runs": len(summ), "runs_ok": len(rates),
        "req_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates)} if rates else None,
        "out_tok_s": {"median": statistics.median(toks), "min": min(toks), "max": max(toks)} if toks else None,
        "cached_pct": 100.0 * sum(q["cached_tokens"] for q in reqs) / prompt if prompt else 0.0,
        "cached_reported": all(q.get("cached_reported", True) for q in reqs),
        "latency_s": _pct([q["done_s"] for q in reqs]),
        "latency_points": _quantile_points([q["done_s"] for q in reqs]),
        "latency_source": sorted({q.get("done_source", "request") for q in reqs}),
        "timings_median_s": {k: statistics.median([q["timings"][k] for q in reqs if k in q.get("timings", {})])
                             for k in timing_keys},
        "per_run": summ,
        "service_path": service_path(runs),
    }


def build_report(runs: list[dict], order: list[str] | None = None) -> dict:
    traces: dict[str, dict] = {}
    for r in runs:
        traces.setdefault(r["trace"]["name"], {}).setdefault(r["label"], []).append(r)
    out = {"traces": {}}
    for name in sorted(traces, key=lambda n: (n != "no-reuse", n)):
        by_label = traces[name]
        labels = [x for x in (order or []) if x in by_label] + sorted(x for x in by_label if x not in (order or []))
        stats = {lab: system_stats(by_label[lab]) for lab in labels}
        first = by_label[labels[0]][0]
        prov = pair_provenance(by_label)
        ratios = [_ratio(labels[0], ref, stats[labels[0]], stats[ref], set(prov["mixed"])) for ref in labels[1:]]
        for r, ref in zip(ratios, labels[1:]):  # the same pairs' output tok/s (the decode trace's other figure)
            r["out_tok_s"] = _ratio(labels[0], ref, stats[labels[0]], stats[ref], set(prov["mixed"]), "out_tok_s")
        out["traces"][name] = {"trace": first["trace"], "systems": labels, "stats": stats, "ratios": ratios,
                               "warnings": warnings(stats, ratios) + prov["warnings"], "provenance": prov,
                               "engine_config": first.get("engine_config"), "placement": first.get("placement"),
                               "policy": {lab: by_label[lab][0]["policy"] for lab in labels},
                               "warmup_shifts": first.get("warmup_shifts")}
    return out


def warnings(stats: dict, ratios: list[dict]) -> list[str]:
    """Why this trace's ratios may mean nothing: too few pairs, or bursts too short for their timing."""
    out = []
    few = sorted({r["pairs"] for r in ratios if r["pairs"] < MIN_PAIRS})
    if few:
        out.append(f"only {few[0]} complete pair(s) behind a ratio (fewer than {MIN_PAIRS}): one or two paired "
                   "ratios cannot show how far the run-to-run noise reaches, so the ratio is not a measured "
                   f"difference; run --pairs {MIN_PAIRS} or more")
    bursts = [s["burst_s"] for st in stats.values() for s in st["per_run"] if s["ok"]]
    if bursts and min(bursts) < MIN_BURST_S:
        out.append(f"the shortest burst took {min(bursts):.3f} s (under {MIN_BURST_S:g} s): a burst's fixed costs "
                   "(batch formation window, per-batch routing and coding, ~15 ms on a 2-core CPU) and timer and "
                   "scheduling noise then exceed the 1% the ratios judge; make the trace longer (--docs, "
                   "--doc-tokens)")
    return out


def _ratio(subj: str, ref: str, a: dict, b: dict, skip: set[int] = frozenset(), key: str = "req_s") -> dict:
    """subj / ref of `key` (req_s or out_tok_s): of the medians (every ok run), and per pair over the pairs both ran
    ok (but those in skip: a pair whose runs mix machines or calls)."""
    ra = {s["pair"]: s.get(key, 0.0) for s in a["per_run"] if s["ok"] and s["pair"] not in skip}
    rb = {s["pair"]: s.get(key, 0.0) for s in b["per_run"] if s["ok"] and s["pair"] not in skip}
    paired = {p: ra[p] / rb[p] for p in sorted(set(ra) & set(rb)) if rb[p] > 0}
    ma, mb = a.get(key), b.get(key)
    med = ma["median"] / mb["median"] if ma and mb and mb["median"] > 0 else None
    vals = list(paired.values())
    return {"subject": subj, "reference": ref, "ratio_of_medians": med, "paired": paired,
            "paired_min": min(vals) if vals else None, "paired_max": max(vals) if vals else None,
            "pairs_at_or_above_floor": sum(v >= PAIR_FLOOR for v in vals), "pairs": len(vals), "floor": PAIR_FLOOR}


def _f(x, fmt: str = "{:.3f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _first_machine_note(t: dict) -> str:
    """The trace's header shows the first record's placement; with several machines that is one of them."""
    n = len((t.get("provenance") or {}).get("machines") or {})
    return f" (the first record's; the pairs ran on {n} machines, listed below)" if n > 1 else ""


def _trace_shape(tr: dict) -> str:
    """What the trace's requests are: the seed's documents and questions, or the decode trace's drawn lengths."""
    if tr.get("max_output_tokens"):
        p, o = tr["prompt_tokens"], tr["output_tokens_drawn"]
        return (f"{tr['num_requests']} prompts sharing nothing, {p['min']}-{p['max']} tokens "
                f"(median {p['median']:.0f}, "
                f"drawn in {tr['min_doc_tokens'] + tr['question_tokens']}-{tr['doc_tokens'] + tr['question_tokens']}); "
                f"answers {o['min']}-{o['max']} tokens (median {o['median']:.0f}, drawn in {tr['output_tokens']}-"
                f"{tr['max_output_tokens']}; {tr['total_output_tokens']} in all), EOS ignored, greedy; ")
    return (f"{tr['num_requests']} requests = {tr['num_docs']} documents x {tr['questions_per_doc']} "
            f"question(s); prompt = {tr['doc_tokens']}-token document + {tr['question_tokens']}-token question "
            f"({tr['prompt_tokens']} tokens); output {tr['output_tokens']} tokens, EOS ignored, greedy; ")


def render_markdown(rep: dict, source: str) -> str:
    lines = ["# Burst benchmark report", "", f"Raw records: `{source}`. Every figure below is recomputed from the "
             "per-request records; runs that failed a check are listed and excluded.", ""]
    for name, t in rep["traces"].items():
        tr = t["trace"]
        lines += [f"## Trace `{name}`", "", _trace_shape(tr) + f"seed {tr['seed']}, digest `{tr['trace_digest']}`.",
                  f"Token ids: {tr['token_source']}. Prefix relation: {tr['prefix_relation']}. "
                  f"Warmup: {len(t['warmup_shifts'] or [])} full rounds shifted by {t['warmup_shifts']} within the "
                  "vocabulary (same lengths and prefix relations, prefixes unseen).",
                  f"Engine limits (flame/engine): `{json.dumps(t['engine_config'])}`; shard -> device "
                  f"`{t['placement']}`{_first_machine_note(t)}; placement policy: {t['policy']}.", "",
                  "| system | runs ok | req/s median [min-max] | output tok/s median [min-max] | cached % | "
                  "completion latency p50 / p90 / p99 (s) |",
                  "|---|---|---|---|---|---|"]
        for lab in t["systems"]:
            s = t["stats"][lab]
            rs, lat = s["req_s"], s["latency_s"]
            rate = f"{rs['median']:.3f} [{rs['min']:.3f}-{rs['max']:.3f}]" if rs else "n/a"
            ts = s.get("out_tok_s")
            toks = f"{ts['median']:.1f} [{ts['min']:.1f}-{ts['max']:.1f}]" if ts else "n/a"
            cached = f"{s['cached_pct']:.2f}" + ("" if s["cached_reported"] else " (not reported)")
            src = "" if s["latency_source"] == ["request"] else " (burst end: no per-request times)"
            lat_s = f"{_f(lat.get('p50'))} / {_f(lat.get('p90'))} / {_f(lat.get('p99'))}{src}" if lat else "n/a"
            lines.append(f"| {lab} | {s['runs_ok']}/{s['runs']} | {rate} | {toks} | {cached} | {lat_s} |")
        if t["ratios"]:
            lines += ["", "| ratio | req/s of medians | paired [min-max] | pairs >= 99% | output tok/s of medians | "
                      "paired [min-max] |", "|---|---|---|---|---|---|"]
            for r in t["ratios"]:
                tok = r.get("out_tok_s") or {}
                lines.append(f"| {r['subject']} / {r['reference']} | {_f(r['ratio_of_medians'], '{:.4f}')} | "
                             f"[{_f(r['paired_min'], '{:.4f}')}-{_f(r['paired_max'], '{:.4f}')}] | "
                             f"{r['pairs_at_or_above_floor']}/{r['pairs']} | "
                             f"{_f(tok.get('ratio_of_medians'), '{:.4f}')} | "
                             f"[{_f(tok.get('paired_min'), '{:.4f}')}-{_f(tok.get('paired_max'), '{:.4f}')}] |")
        lines += [f"\n**Warning: these ratios are not evidence.** {w}." for w in t.get("warnings", [])]
        lines += ["", "| pair | " + " | ".join(f"{lab} req/s (order)" for lab in t["systems"]) + " |",
                  "|---" * (len(t["systems"]) + 1) + "|"]
        pairs = sorted({s["pair"] for lab in t["systems"] for s in t["stats"][lab]["per_run"]})
        for p in pairs:
            cells = []
            for lab in t["systems"]:
                s = next((x for x in t["stats"][lab]["per_run"] if x["pair"] == p), None)
                cells.append("-" if s is None else f"{s['req_s']:.3f} ({s['position']})" + ("" if s["ok"] else
                                                                                           " FAILED"))
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        lines += ["", "Median per-request timings (s): " + "; ".join(
            f"{lab}: " + ", ".join(f"{k} {v:.4f}" for k, v in t["stats"][lab]["timings_median_s"].items())
            for lab in t["systems"])]
        lines += render_provenance(t)
        lines += render_service_path({lab: t["stats"][lab].get("service_path") for lab in t["systems"]})
        bad = [s for lab in t["systems"] for s in t["stats"][lab]["per_run"] if not s["ok"]]
        for s in bad:
            lines.append(f"- FAILED run `{s['path']}`: {s['error'] or ''} {s['failures']}")
        lines.append("")
    return "\n".join(lines)


def write_report(raw_dir: str, out_dir: str | None = None, order: list[str] | None = None) -> dict:
    """Render report.md / report.json / report.png from the raw records under raw_dir."""
    out_dir = out_dir or raw_dir
    if order is None:
        meta = os.path.join(raw_dir, "bench.json")
        if os.path.isfile(meta):
            with open(meta) as f:
                order = json.load(f).get("systems")
    rep = build_report(load_runs(raw_dir), order)
    os.makedirs(out_dir, exist_ok=True)
    rep["png"] = "report.png" if render_png(rep, os.path.join(out_dir, "report.png")) else None
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(rep, f, indent=1)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(render_markdown(rep, raw_dir) + (f"\n![req/s per pair, ratios, latency CDFs, service path]"
                                                 f"({rep['png']})\n" if rep["png"] else ""))
    return rep


# (flags, add_argument kwargs): the `flame-llm report` options
ARGUMENTS = [
    (("raw_dir",), {"help": "a bench or load results dir (holds raw/; `bash bench/records.sh restore DIR` brings it "
                             "back from the results branch), or any dir with raw run JSON below it"}),
    (("--out",), {"default": None, "help": "where report.md/.json/.png go (default: raw_dir)"}),
    (("--systems",), {"default": "", "help": "comma-separated order; the first is the subject of the ratios "
                                          "(of a load report: the first only, default flame)"}),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flags, kwargs in ARGUMENTS:
        p.add_argument(*flags, **kwargs)


def run(a: argparse.Namespace) -> int:
    order = [s for s in a.systems.split(",") if s] or None
    rep = write_report(a.raw_dir, a.out, order)
    print(render_markdown(rep, a.raw_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flame-llm report", description="paired burst report from raw records")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
