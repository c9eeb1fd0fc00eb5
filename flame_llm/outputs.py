from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    """One request's times: seconds on the engine host's perf_counter clock (the *_time fields are instants,
    comparable only within that process; ttft and tpot are durations)."""
    arrival_time: float  # queued in the engine
    first_token_time: float | None = None  # its first output token was read
    finish_time: float | None = None
    ttft: float | None = None  # first_token_time - arrival_time
    tpot: float | None = None  # mean time between output tokens (None with fewer than 2)
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    """One finished request."""
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error" (this request alone failed; `error` says why)
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    text: str | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    error: str | None = None  # why it finished with "error"
