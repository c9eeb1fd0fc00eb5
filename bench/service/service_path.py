"""Where a flame burst's service-path time and bytes go, from the raw records (issue 6's figures).

Each flame run's raw record holds `stats.burst`: the measured burst's counters alone (after minus before,
so warmup is excluded). Client side: formed batches, router calls, msgpack (raw) vs zstd (wire) payload
bytes, seconds in routing calls, request encoding and result decoding. Actor side, summed over shards:
batch decode + validation, result encoding. Per request: the wait for admission (`queue_s`, from batch
arrival to the engine taking the request) and the engine time (`engine_s`).
"""
from __future__ import annotations

import statistics

import numpy as np


def run_service_path(run: dict) -> dict | None:
    burst = (run.get("stats") or {}).get("burst")
    if not burst:
        return None
    c, actors = burst["client"], burst["actors"]
    batches = max(c["batches"], 1)
    reqs = run["requests"]
    queue = [q["timings"]["queue_s"] for q in reqs if "queue_s" in q.get("timings", {})]
    return {
        "batches": c["batches"], "route_calls": c["route_calls"], "prompts_per_batch": len(reqs) / batches,
        "payload_raw_bytes": c["payload_raw_bytes"], "payload_wire_bytes": c["payload_wire_bytes"],
        "compression": c["payload_raw_bytes"] / c["payload_wire_bytes"] if c["payload_wire_bytes"] else None,
        "per_batch_ms": {
            "route": 1e3 * c["route_s"] / max(c["route_calls"], 1),
            "client_encode": 1e3 * c["encode_s"] / batches,
            "actor_decode": 1e3 * sum(a["decode_s"] for a in actors) / max(sum(a["batches"] for a in actors), 1),
            "actor_encode": 1e3 * sum(a["encode_s"] for a in actors) / max(sum(a["batches"] for a in actors), 1),
            "client_result_decode": 1e3 * c["result_decode_s"] / batches},
        "admission_wait_s": ({"p50": float(np.percentile(queue, 50)), "p99": float(np.percentile(queue, 99))}
                             if queue else None),
        "service_s": c["route_s"] + c["encode_s"] + c["result_decode_s"]
                     + sum(a["decode_s"] + a["encode_s"] for a in actors),
        "burst_s": max((q["done_s"] for q in reqs), default=0.0),
    }


def service_path(runs: list[dict]) -> dict | None:
    """Medians over a system's good runs (None for systems without service counters)."""
    per = [p for r in runs if r["checks"]["ok"] and (p := run_service_path(r)) is not None]
    if not per:
        return None

    def med(get) -> float | None:
        xs = [x for p in per if (x := get(p)) is not None]
        return statistics.median(xs) if xs else None

    keys = per[0]["per_batch_ms"]
    return {"runs": len(per), "batches": med(lambda p: p["batches"]),
            "prompts_per_batch": med(lambda p: p["prompts_per_batch"]),
            "payload_raw_bytes": med(lambda p: p["payload_raw_bytes"]),
            "payload_wire_bytes": med(lambda p: p["payload_wire_bytes"]),
            "compression": med(lambda p: p["compression"]),
            "per_batch_ms": {k: med(lambda p, k=k: p["per_batch_ms"][k]) for k in keys},
            "admission_wait_p50_s": med(lambda p: (p["admission_wait_s"] or {}).get("p50")),
            "admission_wait_p99_s": med(lambda p: (p["admission_wait_s"] or {}).get("p99")),
            "service_share_of_burst": med(lambda p: p["service_s"] / p["burst_s"] if p["burst_s"] else None)}


def render(by_label: dict[str, dict | None]) -> list[str]:
    rows = {lab: sp for lab, sp in by_label.items() if sp}
    if not rows:
        return []
    keys = list(next(iter(rows.values()))["per_batch_ms"])
    lines = ["", "Service path per measured burst (median over runs; warmup excluded; per-batch times in ms; "
             "`service %` = those serial seconds over the burst's wall time, an upper bound on what they cost "
             "since shards and the client overlap them):", "",
             "| system | batches | prompts/batch | payload raw / wire MiB (x) | "
             + " | ".join(keys) + " | admission wait p50 / p99 (s) | service % |",
             "|---" * (6 + len(keys)) + "|"]
    for lab, sp in rows.items():
        mib = f"{sp['payload_raw_bytes'] / 2**20:.2f} / {sp['payload_wire_bytes'] / 2**20:.2f}"
        comp = f" ({sp['compression']:.2f}x)" if sp["compression"] else ""
        wait = (f"{sp['admission_wait_p50_s']:.4f} / {sp['admission_wait_p99_s']:.4f}"
                if sp["admission_wait_p50_s"] is not None else "n/a")
        share = f"{100 * sp['service_share_of_burst']:.2f}" if sp["service_share_of_burst"] is not None else "n/a"
        lines.append(f"| {lab} | {sp['batches']:.0f} | {sp['prompts_per_batch']:.1f} | {mib}{comp} | "
                     + " | ".join(f"{sp['per_batch_ms'][k]:.3f}" for k in keys) + f" | {wait} | {share} |")
    return lines
