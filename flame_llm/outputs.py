from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """One finished request. Times are seconds on the engine host's perf_counter clock."""
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error" (this request alone failed; metrics["error"] says why)
    num_prompt_tokens: int
    num_cached_tokens: int
    text: str | None = None
    metrics: dict = field(default_factory=dict)  # arrival, first_token, finish, ttft, tpot, preemptions
