"""What an engine actor counts, shipped in its stats() and turned into Prometheus counters and histograms by
flame_llm.serving.metrics: its batches, requests and streams, their tokens and payload bytes, and per-shard
latencies and batch sizes (plain counts per bucket), for every client of the shard."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from flame_llm.protocol.types import Result

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


@dataclass(slots=True)
class Histogram:
    """Counts per bucket (upper bounds, inclusive; the last count is above every bound), with sum and count."""
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum,
                "count": sum(self.counts)}


def shard_histograms() -> dict[str, Histogram]:
    """What a shard measures: requests per batch; per request its admission wait, time to first token and per
    output token (the engine's), and its time at the shard from arrival to result (end to end at the shard)."""
    return {"batch_requests": Histogram(BATCH_BUCKETS), "queue_s": Histogram(LATENCY_BUCKETS_S),
            "ttft_s": Histogram(LATENCY_BUCKETS_S), "tpot_s": Histogram(LATENCY_BUCKETS_S),
            "e2e_s": Histogram(LATENCY_BUCKETS_S)}


def _counters() -> dict[str, float]:
    return {"batches": 0, "requests": 0, "streams": 0, "bad_batches": 0, "errors": 0, "cached_tokens": 0,
            "prompt_tokens": 0, "output_tokens": 0, "decode_s": 0.0, "encode_s": 0.0,
            # request payloads as they travel (zstd) and decoded (msgpack, from the frame header)
            "payload_wire_bytes": 0, "payload_raw_bytes": 0, "result_wire_bytes": 0}


# a served request's timings (Result.timings keys) -> the histogram each goes to
_TIMING_HISTOGRAMS = (("queue_s", "queue_s"), ("total_s", "e2e_s"), ("ttft", "ttft_s"), ("tpot", "tpot_s"))


@dataclass(slots=True)
class ShardMetrics:
    """An engine actor's counters (by name) and histograms (shard_histograms)."""
    counters: dict[str, float] = field(default_factory=_counters)
    hist: dict[str, Histogram] = field(default_factory=shard_histograms)

    def batch(self, wire_bytes: int, raw_bytes: int, num_requests: int) -> None:
        """A readable request payload of wire_bytes (raw_bytes decoded; < 0: unknown) holding num_requests."""
        self.counters["payload_wire_bytes"] += wire_bytes
        self.counters["payload_raw_bytes"] += max(raw_bytes, 0)
        self.hist["batch_requests"].observe(num_requests)

    def served(self, res: Result) -> None:
        """A request the engine ran to its end: its tokens and its times."""
        c = self.counters
        c["requests"] += 1
        c["prompt_tokens"] += res.prompt_tokens
        c["cached_tokens"] += res.cached_tokens
        c["output_tokens"] += len(res.output_token_ids)
        for key, name in _TIMING_HISTOGRAMS:
            if key in res.timings:
                self.hist[name].observe(res.timings[key])

    def to_dict(self) -> dict:
        return {**self.counters, "histograms": {k: h.to_dict() for k, h in self.hist.items()}}
