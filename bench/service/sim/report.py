"""A simulated run's figures: prefix hit rate, throughput, TTFT, routing decision latency and router CPU."""
from __future__ import annotations

import numpy as np

from bench.service.sim.cluster import Cluster


def pct(xs, q: float) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def summarize(c: Cluster, wall_s: float) -> dict:
    cfg, done = c.cfg, list(c.done.values())
    prompt = sum(cfg.doc_tokens + cfg.question_tokens for _ in done)
    cached = sum(r.cached for r in done)
    end = max((r.end for r in done), default=0.0)
    ttft = [r.ttft for r in done]
    calls_us = np.asarray(c.call_s) * 1e6
    per_req_us = np.repeat(calls_us / np.maximum(1, np.asarray(c.call_sizes)), c.call_sizes) if c.call_s else []
    kv_tokens = cfg.num_shards * cfg.num_blocks * 128
    return {
        "policy": cfg.policy, "shards": cfg.num_shards, "replicas": cfg.num_replicas, "offered_rps": cfg.rate,
        "requests": len(c.reqs), "completed": len(done), "lost": len(c.reqs) - len(done),
        "docs_over_kv": round(cfg.num_docs * cfg.doc_tokens / kv_tokens, 2),
        "hit_rate": cached / prompt if prompt else 0.0,
        # completions over the whole run (the last shard's tail decides it), and inside the arrival window only
        "throughput_rps": len(done) / end if end else 0.0, "makespan_s": end,
        "window_rps": sum(1 for r in done if r.end <= cfg.duration_s) / cfg.duration_s,
        "p90_done_s": pct([r.end for r in done], 90),
        "prefill_tokens": sum(s.prefill_tokens for s in c.shards),
        "preemptions": sum(s.scheduler.counts.num_preemptions for s in c.shards),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "route_call_us_p50": pct(calls_us, 50), "route_call_us_p99": pct(calls_us, 99),
        "route_call_cpu_us_p50": pct(np.asarray(c.call_cpu_s) * 1e6, 50),
        "route_call_cpu_us_p99": pct(np.asarray(c.call_cpu_s) * 1e6, 99),
        "route_us_per_req_p50": pct(per_req_us, 50), "route_us_per_req_p99": pct(per_req_us, 99),
        "mean_call_size": float(np.mean(c.call_sizes)) if c.call_sizes else 0.0,
        "router_cpu_us_per_req": c.router_cpu_s / max(1, len(c.reqs)) * 1e6,
        "resync_cpu_s": c.resync_s, **c.counts, "wall_s": wall_s,
    }
