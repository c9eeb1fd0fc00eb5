"""Sampling: greedy, temperature, top-k, top-p, per-request seeds.

A sampled token is argmax(probs / E) with E ~ Exp(1) per vocab entry (the exponential race, an exact
draw from probs). A seeded request draws E from a generator keyed by (seed, output position), so
its samples do not depend on which other requests share the batch or on preemption.

`sample_rows` isolates a poison row: when a batch cannot be built or sampled, the rows that fail on their
own are reported failed (sampled greedily as placeholders) and the others sampled as usual."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flame_llm.sampling_params import SamplingParams

_PLACEHOLDER = SamplingParams(temperature=0.0)  # what a failed row is sampled with


@dataclass(slots=True)
class SamplingBatch:
    temperatures: torch.Tensor | None  # float32 [B]; 0 = greedy; None when every row is greedy
    top_ks: torch.Tensor | None  # int64 [B], vocab size where off; None if no row uses top-k
    top_ps: torch.Tensor | None  # float32 [B], 1.0 where off; None if no row uses top-p
    seeds: list[tuple[int, int]]  # (row, key) for seeded rows
    all_greedy: bool


def make_sampling_batch(params: list, positions: list[int], vocab_size: int,
                        device: torch.device) -> SamplingBatch:
    """params: SamplingParams per row; positions: the output index each row samples."""
    temps = [p.temperature for p in params]
    all_greedy = all(t == 0.0 for t in temps)
    if all_greedy:  # argmax only: no per-step host-to-device copies for parameters nobody reads
        return SamplingBatch(None, None, None, [], True)
    top_ks = top_ps = None
    if any(p.top_k > 0 for p in params):
        top_ks = _to_device([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], torch.int64,
                            device)
    if any(p.top_p < 1.0 for p in params):
        top_ps = _to_device([p.top_p for p in params], torch.float32, device)
    seeds = [(i, (p.seed * 1_000_003 + pos) % (2**63)) for i, (p, pos) in enumerate(zip(params, positions))
             if p.seed is not None and p.temperature > 0]
    return SamplingBatch(_to_device(temps, torch.float32, device), top_ks, top_ps, seeds, all_greedy)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A copy that does not wait for the device: from pinned memory (a pageable copy syncs the stream)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None,
                      top_ps: torch.Tensor | None) -> torch.Tensor:
    if top_ks is None and top_ps is None:
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_ks is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        drop |= ranks[None, :] >= top_ks[:, None]
    if top_ps is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop |= mass_before >= top_ps[:, None]
        drop[:, 0] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits float32 [B, V] -> token ids int64 [B]."""
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    temps = batch.temperatures
    scaled = logits / torch.where(temps > 0, temps, 1.0)[:, None]
    probs = apply_top_k_top_p(scaled, batch.top_ks, batch.top_ps).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, key in batch.seeds:
        gen = torch.Generator(device=probs.device).manual_seed(key)
        noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temps > 0, sampled, greedy)


def sample_rows(logits: torch.Tensor, params: list, positions: list[int], vocab_size: int,
                device: torch.device) -> tuple[torch.Tensor, dict[int, str]]:
    """Token ids [B] and {row: error message} of the rows whose sampling fails on its own. When the batch
    fails, each row is tried alone; the failing rows get a greedy placeholder token and the rest are
    sampled together (a seeded or greedy row draws the same token as without the poison). A failure no
    row causes alone is re-raised: it cannot be pinned on a request."""
    try:
        return sample(logits, make_sampling_batch(params, positions, vocab_size, device)), {}
    except Exception:
        failed = {}
        for i, (p, pos) in enumerate(zip(params, positions)):
            try:
                sample(logits[i:i + 1], make_sampling_batch([p], [pos], vocab_size, device))
            except Exception as e:  # noqa: BLE001 - any failure of the row alone pins it on the row
                failed[i] = f"sampling failed for this request ({type(e).__name__}: {str(e)[:200]})"
        if not failed:
            raise
    rest = [_PLACEHOLDER if i in failed else p for i, p in enumerate(params)]
    return sample(logits, make_sampling_batch(rest, positions, vocab_size, device)), failed
