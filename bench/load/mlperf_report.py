"""The record side of `flame-llm bench --mode loadgen` (bench/load/mlperf.py): LoadGen's summary file parsed, and the
report (OUT/loadgen.json, OUT/loadgen.md) merged from every system's record in OUT/raw/loadgen-*.json, so systems run
in separate calls into one --out give one report."""

from __future__ import annotations

import json
import os
import re

LOADGEN_FORMAT = "flame-loadgen/1"
NOTE = (
    "MLPerf-style, not an MLPerf submission: LoadGen 6.0.17 drives synthetic token ids with llama3.1-8b-like "
    "lengths (CNN/DailyMail), dummy weights, no accuracy run, short runs"
)


def parse_summary(text: str) -> dict:
    """LoadGen's mlperf_log_summary.txt: its result, throughput and latency percentiles (seconds)."""
    kv = {}
    for line in text.split("Test Parameters Used")[0].splitlines():
        if ":" in line:
            k, _, v = line.partition(":")
            kv.setdefault(k.strip().lower(), v.strip())

    def num(*keys: str) -> float | None:
        for k in keys:
            if k in kv and re.fullmatch(r"[-+0-9.e]+", kv[k]):
                return float(kv[k])
        return None

    def ns(key: str) -> float | None:
        v = num(key)
        return None if v is None else v / 1e9

    result = kv.get("result is")
    assert result in ("VALID", "INVALID"), f"no 'Result is' line in LoadGen's summary: {text[:300]!r}"
    return {
        "result": result,
        "valid": result == "VALID",
        "scenario": kv.get("scenario"),
        "samples_per_s": num("samples per second", "completed samples per second"),
        "tokens_per_s": num("tokens per second", "completed tokens per second"),
        "scheduled_samples_per_s": num("scheduled samples per second"),
        "latency_p99_s": ns("99.00 percentile latency (ns)"),
        "ttft_p50_s": ns("50.00 percentile first token latency (ns)"),
        "ttft_p99_s": ns("99.00 percentile first token latency (ns)"),
        "tpot_p50_s": ns("50.00 percentile time to output token (ns)"),
        "tpot_p99_s": ns("99.00 percentile time to output token (ns)"),
        "constraints_satisfied": kv.get("performance constraints satisfied"),
        "early_stopping_satisfied": kv.get("early stopping satisfied"),
        "min_duration_satisfied": kv.get("min duration satisfied"),
        "min_queries_satisfied": kv.get("min queries satisfied"),
    }


def write_report(out: str) -> str:
    """OUT/loadgen.{json,md} from every OUT/raw/loadgen-*.json (calls of one system each merge); the Markdown."""
    raw = os.path.join(out, "raw")
    recs = []
    for name in sorted(os.listdir(raw)):
        if name.startswith("loadgen-") and name.endswith(".json"):
            with open(os.path.join(raw, name)) as f:
                recs.append(json.load(f))
    rows, best = [], {}
    for r in recs:
        for run in r["runs"]:
            rows.append((r["system"], run))
        best[r["system"]] = {
            "offline_tokens_per_s": max(
                (x["tokens_per_s"] or 0 for x in r["runs"] if x["scenario_name"] == "offline" and x["valid"]),
                default=None,
            ),
            **{f"{s}_highest_valid_qps": v["highest_valid_qps"] for s, v in (r.get("find_qps") or {}).items()},
        }
    with open(os.path.join(out, "loadgen.json"), "w") as f:
        json.dump({"format": LOADGEN_FORMAT, "note": NOTE, "summary": best, "records": recs}, f, indent=1)

    def ms(v):
        return "" if v is None else f"{v * 1000:.1f}"

    def qps(v):
        return "" if not v else f"{v:.4g}"

    lines = [
        "# LoadGen: MLPerf scenarios, MLPerf-style",
        "",
        f"**{NOTE}.**",
        "",
        "| system | scenario | target qps | LoadGen | ours | samples/s | output tok/s | TTFT p99 ms | "
        "TPOT p99 ms | failed | logs |",
        "|" + "---|" * 11,
    ]
    for label, x in rows:
        lines.append(
            f"| {label} | {x['scenario_name']} | {qps(x['target_qps'])} | {x['result']} | "
            f"{'valid' if x['valid'] else 'invalid'} | {x['samples_per_s']} | {x['tokens_per_s']} | "
            f"{ms(x['ttft_p99_s'])} | {ms(x['tpot_p99_s'])} | {x['counters']['failed']} | "
            f"{os.path.relpath(x['logs'], out)} |"
        )
    lines += ["", "| system | Offline tok/s (valid) | highest valid QPS |", "|---|---|---|"]
    for label, b in best.items():
        q = ", ".join(
            f"{k.split('_')[0]} {qps(v)}" if v else f"{k.split('_')[0]}: none valid"
            for k, v in b.items()
            if k.endswith("_qps")
        )
        lines.append(f"| {label} | {b['offline_tokens_per_s']} | {q} |")
    if recs:
        d = recs[0]["dataset"]
        lines += [
            "",
            f"Dataset: {d['samples']} samples, input tokens mean {d['input_tokens']['mean']:.0f} "
            f"(max {d['input_tokens']['max']}), output tokens mean {d['output_tokens']['mean']:.0f} "
            f"(max {d['output_tokens']['max']}), len_scale {d['len_scale']}: {d['note']}.",
        ]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(out, "loadgen.md"), "w") as f:
        f.write(md)
    return md
