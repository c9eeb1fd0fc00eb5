"""The dataset of `flame-llm bench --mode loadgen`: synthetic token ids shaped like MLPerf Inference's llama3.1-8b task
(CNN/DailyMail summarization). MLPerf-style, NOT an MLPerf submission: no real weights, no real articles, no
accuracy run; only the shape of the work (how many prompt tokens, how many answer tokens) follows the reference.

What the reference fixes (mlcommons/inference, language/llama3.1-8b and loadgen/mlperf.conf, read 2026-12-05):
- 13,368 samples (the CNN/DailyMail validation set; `llama3_1-8b.*.performance_sample_count_override`, and Offline's
  `min_query_count`), prompts tokenized with max_length 2,048 (PREPROCESSING.md: chat template + article);
- the BF16 accuracy target's gen_len: 8,167,644 characters over 13,368 summaries, ~611 characters each, i.e.
  ~135 Llama-3 tokens at ~4.5 characters a token;
- Server bounds: TTFT p99 <= 2,000 ms, TPOT p99 <= 100 ms; Interactive (llama3_1-8b-interactive): 500 ms, 30 ms.
The reference's per-sample token histogram is not in those files: the lognormal parameters below (median prompt
~780 tokens: a ~600-word article at ~1.3 tokens a word plus the template, clipped to 2,048; median answer ~128
tokens, mean ~135) are our estimate from them, kept here in one place so a measured histogram can replace them.
Every answer is generated to its drawn length (EOS ignored), so both systems do the same work."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

REFERENCE_SAMPLES = 13_368  # CNN/DailyMail validation, as the reference's dataset and mlperf.conf
# (TTFT, TPOT) p99 bounds in seconds per scenario (loadgen/mlperf.conf: llama3_1-8b and llama3_1-8b-interactive)
LATENCY_BOUNDS_S = {"server": (2.0, 0.100), "interactive": (0.5, 0.030)}
# our estimate of the reference's token lengths (module docstring): lognormal median, sigma, clipped to [lo, hi]
REFERENCE_INPUT = {"median": 780, "sigma": 0.45, "lo": 64, "hi": 2048}
REFERENCE_OUTPUT = {"median": 128, "sigma": 0.35, "lo": 2, "hi": 512}


@dataclass(slots=True)
class LengthDist:
    """A lognormal token count: median, sigma of its log, clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
        x = rng.lognormal(np.log(self.median), self.sigma, n)
        x = np.clip(np.rint(x), self.lo, self.hi)
        return np.maximum(1, np.rint(x * scale)).astype(np.int64)


@dataclass(slots=True)
class DatasetConfig:
    samples: int = REFERENCE_SAMPLES
    input_len: LengthDist = field(default_factory=lambda: LengthDist(**REFERENCE_INPUT))
    output_len: LengthDist = field(default_factory=lambda: LengthDist(**REFERENCE_OUTPUT))
    len_scale: float = 1.0  # both lengths x this (CPU runs of the tiny model: the same shape, less work)
    vocab_size: int = 128_256
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"loadgen field 'samples' (--mlperf-samples) must be an int >= 1; got {self.samples!r}")
        if not 0 < self.len_scale <= 1:
            raise ValueError(f"loadgen field 'len_scale' (--mlperf-len-scale) must be in (0, 1]; got {self.len_scale}")
        if self.vocab_size < 2:
            raise ValueError(f"loadgen field 'vocab_size' must be >= 2; got {self.vocab_size!r}")

    def max_total_tokens(self) -> int:
        """The longest prompt + answer a sample can have (a server's max_model_len must hold it)."""
        return max(1, round(self.input_len.hi * self.len_scale)) + max(1, round(self.output_len.hi * self.len_scale))


@dataclass(slots=True)
class Dataset:
    input_ids: list[np.ndarray]  # int32 token ids per sample
    output_lens: np.ndarray  # answer tokens per sample (max_tokens, EOS ignored)
    config: DatasetConfig

    def __len__(self) -> int:
        return len(self.input_ids)

    def stats(self) -> dict:
        ins = np.array([len(x) for x in self.input_ids])
        outs = self.output_lens

        def d(a: np.ndarray) -> dict:
            return {
                "mean": float(a.mean()),
                "p50": float(np.percentile(a, 50)),
                "p90": float(np.percentile(a, 90)),
                "min": int(a.min()),
                "max": int(a.max()),
                "total": int(a.sum()),
            }

        return {
            "samples": len(self),
            "input_tokens": d(ins),
            "output_tokens": d(outs),
            "len_scale": self.config.len_scale,
            "seed": self.config.seed,
            "note": "synthetic token ids, MLPerf llama3.1-8b-like lengths (estimated; bench/load/mlperf_data.py)",
        }


def make_dataset(cfg: DatasetConfig) -> Dataset:
    """Seeded: the same config gives the same samples on every machine and for every system."""
    rng = np.random.default_rng(cfg.seed)
    ins = cfg.input_len.draw(rng, cfg.samples, cfg.len_scale)
    outs = cfg.output_len.draw(rng, cfg.samples, cfg.len_scale)
    ids = [rng.integers(0, cfg.vocab_size, int(n), dtype=np.int32) for n in ins]
    return Dataset(ids, outs, cfg)
