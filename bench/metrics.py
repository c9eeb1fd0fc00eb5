"""Run metrics shared by the benchmarks.

Per request: TTFT (arrival to first token) and TPOT (mean gap between later tokens), read from
RequestOutput.metrics. Per run, from those and LLMEngine.stats(): P50/P99 latencies, prefill and
decode throughput (tokens computed over the time of the steps that computed them: a step with any
prefill tokens counts as prefill time), peak memory, step and preemption counts, and prefix-cache
figures (hit rate = cached prompt tokens / prompt tokens looked up at admission, recomputations
after preemption included; saved tokens = those cached tokens; evictions = cached blocks reused).
"""
from __future__ import annotations

import math
import resource
import sys
from collections.abc import Iterable

import torch

from flame_llm.outputs import RequestOutput


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear between closest ranks); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100]; got {q!r}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def request_latencies(outputs: Iterable[RequestOutput]) -> tuple[list[float], list[float]]:
    """(TTFTs, TPOTs) in seconds; a request with one output token has no TPOT."""
    ttft, tpot = [], []
    for out in outputs:
        if out.metrics.ttft is not None:
            ttft.append(out.metrics.ttft)
        if out.metrics.tpot is not None:
            tpot.append(out.metrics.tpot)
    return ttft, tpot


def latency_ms(values: list[float], prefix: str) -> dict:
    p50, p99 = percentile(values, 50), percentile(values, 99)
    return {f"{prefix}_p50_ms": None if p50 is None else p50 * 1e3,
            f"{prefix}_p99_ms": None if p99 is None else p99 * 1e3}


def peak_memory_bytes() -> int:
    """Peak CUDA memory allocated by torch in this process when CUDA is in use, else peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def _rate(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def summarize(outputs: list[RequestOutput], engine_stats: dict, wall_s: float) -> dict:
    """One run's figures: `outputs` are its finished requests, `engine_stats` LLMEngine.stats() taken
    after it (counters reset before it), `wall_s` the time from first submission to last completion."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0; got {wall_s!r}")
    ttft, tpot = request_latencies(outputs)
    s = engine_stats
    prompt = sum(o.num_prompt_tokens for o in outputs)
    generated = sum(len(o.output_token_ids) for o in outputs)
    return {
        "num_requests": len(outputs), "wall_s": wall_s,
        **latency_ms(ttft, "ttft"), **latency_ms(tpot, "tpot"),
        "prompt_tokens": prompt, "output_tokens": generated,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
        "requests_per_s": len(outputs) / wall_s, "output_tokens_per_s": generated / wall_s,
        "prefill_tokens_per_s": _rate(s.get("num_prefill_tokens", 0), s.get("prefill_time_s", 0.0)),
        "decode_tokens_per_s": _rate(s.get("num_decode_tokens", 0), s.get("decode_time_s", 0.0)),
        "peak_memory_bytes": peak_memory_bytes(),
        "prefill_steps": s.get("num_prefill_steps"), "decode_steps": s.get("num_decode_steps"),
        "mixed_steps": s.get("num_mixed_steps"), "preemptions": s.get("num_preemptions"),
        "prefix_hit_rate": _rate(s.get("prefix_hit_tokens", 0), s.get("prefix_query_tokens", 0)),
        "saved_tokens": s.get("prefix_hit_tokens"), "evictions": s.get("evictions"),
        "prefill_tokens": s.get("num_prefill_tokens"), "deferred_admissions": s.get("num_deferred_admissions"),
    }
