"""Per-segment time of speculative steps, on when FLAME_SPEC_PROFILE=1 (the engine holds None otherwise).

On CUDA a mark records an event on the stream and the intervals are read after the step's one host
sync, so profiling adds no sync of its own; on CPU marks are wall-clock times."""
from __future__ import annotations

import os
import time
from collections import defaultdict

import torch

PROFILE_ENV = "FLAME_SPEC_PROFILE"


def profiling_enabled() -> bool:
    return os.environ.get(PROFILE_ENV, "") == "1"


class StepProfiler:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._marks: list[tuple[str, object]] = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [("", self._now())]

    def mark(self, segment: str) -> None:
        """End the current segment, naming it."""
        self._marks.append((segment, self._now()))

    def stop(self) -> None:
        """Accumulate the step's segments; on CUDA call after the step has synchronized."""
        if self.cuda and self._marks:
            self._marks[-1][1].synchronize()
        prev = self._marks[0][1]
        for segment, t in self._marks[1:]:
            self.totals[segment] += prev.elapsed_time(t) / 1e3 if self.cuda else t - prev
            self.counts[segment] += 1
            prev = t
        self._marks = []

    def summary(self) -> dict[str, float]:
        """Mean milliseconds per step in which each segment ran."""
        return {segment: 1e3 * total / self.counts[segment] for segment, total in self.totals.items()}
