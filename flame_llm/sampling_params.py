from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and its limit."""
        _need(isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0,
              "temperature", "a number in [0, 100]", self.temperature)
        _need(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
              "top_k", "-1 (off) or an integer >= 1", self.top_k)
        _need(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1",
              self.max_tokens)
        _need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "non-negative integers", self.stop_token_ids)
        _need(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "seed",
              "None or an integer in [0, 2**63)", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SamplingParamsError(ValueError):
    """A sampling parameter outside its limits; `field` names it (front doors report it without parsing)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _need(ok: bool, name: str, limit: str, value: object) -> None:
    if not ok:
        raise SamplingParamsError(name, f"sampling parameter {name!r} must be {limit}; got {value!r}")
