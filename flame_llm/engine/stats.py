"""The scheduler's counters (part of the engine's stats())."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_deferred_admissions: int = 0  # prefix dedup: a request passed over for a step
    num_prefill_steps: int = 0  # steps with any prefill tokens (mixed steps included)
    num_decode_steps: int = 0  # steps of decodes only
    num_mixed_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    prefill_time_s: float = 0.0  # schedule-to-complete time of prefill steps
    decode_time_s: float = 0.0

    def count_step(self, num_prefill: int, num_decode: int) -> None:
        if num_prefill:
            self.num_prefill_steps += 1
            self.num_mixed_steps += num_decode > 0
        else:
            self.num_decode_steps += 1
        self.num_prefill_tokens += num_prefill
        self.num_decode_tokens += num_decode

    def count_time(self, start: float, has_prefill: bool, now: float) -> None:
        if has_prefill:
            self.prefill_time_s += now - start
        else:
            self.decode_time_s += now - start
