"""The workloads load mode's document-QA stream can be (issue 18 item 6), as pure seeded functions:

- answer lengths drawn from a distribution (`--output-len 16`, `uniform:16-1024`, `lognormal:16-1024`, or a preset:
  `qa`, lognormal 32-512 with median 128, the default since issue 39: a fixed 16-token answer hides decode; `long`,
  lognormal 64-1,024; `fixed`, --output-tokens each, the seed's 16),
- documents asked about with Zipf-skewed popularity (`--doc-zipf S`: document k of the mix is asked with weight
  1 / (k + 1)**S, so a few prefixes are hot), or uniformly (S = 0),
- more distinct documents than the KV cache holds (`--docs N`; the report states both in tokens),
- a shard killed mid-window (`--kill-shard-at S`, in bench/load/mode.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DISTS = ("fixed", "uniform", "lognormal")
# named answer-length specs: a chat or QA answer (issue 39's measured stream), a longer one; "fixed" is LoadConfig's
# --output-tokens each (resolved there: it knows that value)
PRESETS = {"qa": "lognormal:32-512", "long": "lognormal:64-1024"}
DEFAULT_OUTPUT_LEN = "qa"


@dataclass(frozen=True, slots=True)
class OutputLen:
    """Answer lengths in tokens: `fixed` lo, or drawn in [lo, hi] uniformly or lognormally (median sqrt(lo*hi),
    ~99.7% of the mass inside [lo, hi] before clipping)."""
    dist: str = "fixed"
    lo: int = 16
    hi: int = 16

    def __post_init__(self) -> None:
        if self.dist not in DISTS:
            raise ValueError(f"output length distribution must be one of {DISTS}; got {self.dist!r}")
        if not (1 <= self.lo <= self.hi) or (self.dist == "fixed" and self.lo != self.hi):
            raise ValueError(f"output lengths need 1 <= lo <= hi (lo == hi when fixed); got {self.lo}-{self.hi}")

    @classmethod
    def parse(cls, spec: str) -> OutputLen:
        """"N" (fixed), "uniform:LO-HI", "lognormal:LO-HI" or a preset name (PRESETS); ValueError naming the field
        otherwise."""
        s = PRESETS.get(spec.strip(), spec.strip())
        try:
            if ":" not in s:
                n = int(s)
                return cls("fixed", n, n)
            dist, rng = s.split(":", 1)
            lo, hi = (int(x) for x in rng.split("-", 1))
            return cls(dist.strip(), lo, hi)
        except ValueError as e:
            if "output length" in str(e):
                raise
            raise ValueError(f"--output-len must be N, uniform:LO-HI, lognormal:LO-HI, fixed or one of "
                             f"{sorted(PRESETS)}; got {spec!r}") from None

    def spec(self) -> str:
        return str(self.lo) if self.dist == "fixed" else f"{self.dist}:{self.lo}-{self.hi}"

    def draw(self, rng: np.random.Generator) -> int:
        if self.dist == "fixed":
            return self.lo
        if self.dist == "uniform":
            return int(rng.integers(self.lo, self.hi + 1))
        mu = 0.5 * (math.log(self.lo) + math.log(self.hi))
        sigma = max((math.log(self.hi) - math.log(self.lo)) / 6.0, 1e-9)
        return int(min(self.hi, max(self.lo, round(rng.lognormal(mu, sigma)))))

    @property
    def max(self) -> int:
        return self.hi


def doc_weights(num_docs: int, zipf_s: float) -> np.ndarray:
    """Probability of each document being asked about: uniform (s = 0) or Zipf with exponent s."""
    if zipf_s < 0:
        raise ValueError(f"doc_zipf must be >= 0; got {zipf_s!r}")
    w = 1.0 / np.arange(1, num_docs + 1, dtype=float) ** zipf_s
    return w / w.sum()


def draw_doc(rng: np.random.Generator, weights: np.ndarray) -> int:
    """One document index; the uniform case draws exactly as the seed's stream did (rng.integers)."""
    if np.all(weights == weights[0]):
        return int(rng.integers(len(weights)))
    return int(rng.choice(len(weights), p=weights))


def hot_share(docs: list[int], top: int = 1) -> float:
    """The fraction of requests that asked about the `top` most asked documents."""
    if not docs:
        return 0.0
    counts = np.bincount(np.asarray(docs))
    return float(np.sort(counts)[::-1][:top].sum() / len(docs))


def kill_effect(outcomes: list, kill: dict) -> dict:
    """What a shard kill did to a window: the requests in flight at the kill (sent before it, not finished),
    which of them failed, the longest gap between tokens of those that spanned it, and the restart time."""
    at = kill.get("at_s")
    if at is None:
        return {**kill, "fired": False}

    def end(o) -> float:
        return o.sent_s + o.e2e_s if o.e2e_s is not None else float("inf")

    hit = [o for o in outcomes if o.sent_s <= at < end(o)]
    gaps = [max((b - a for a, b in zip([0.0, *o.chunk_s], o.chunk_s)), default=0.0) for o in hit if o.error is None]
    after = [o for o in outcomes if o.sent_s > at]
    back = at + kill["recovery_s"] if kill.get("recovery_s") is not None else float("inf")
    during = [o.ttft_s for o in outcomes if at < o.sent_s <= back and o.ttft_s is not None]
    return {**kill, "fired": True, "in_flight": len(hit), "failed": sum(o.error is not None for o in hit),
            "errors": sorted({o.error for o in hit if o.error})[:3],
            "max_gap_s": max(gaps, default=None), "sent_after": len(after),
            "failed_after": sum(o.error is not None for o in after),
            "sent_during_restart": len(during), "ttft_max_during_restart_s": max(during, default=None)}
