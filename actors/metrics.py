"""Histograms an engine actor keeps (plain counts, shipped in stats() and turned into Prometheus histograms by
flame_llm.serving.metrics): per-shard latencies and batch sizes, for every client of the shard."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

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
