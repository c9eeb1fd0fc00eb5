"""Which draft tokens the target accepts, and the token that follows them.

Greedy rows: a proposal is accepted while it equals the target's argmax; the emitted token after the
accepted run is the target's argmax there (so the output is exactly the target's greedy output).

Sampled rows (exact rejection sampling): proposal x_i drawn from the draft's q_i is kept with
probability min(1, p_i(x_i) / q_i(x_i)). At the first rejection the emitted token comes from the
normalized max(p_i - q_i, 0); when all K proposals are kept it comes from p_{K+1} (the bonus). Each
emitted token is then distributed exactly as the target's p at its position. Draws use the
exponential race (argmax of weights / Exp(1) noise), as the plain sampler does."""
from __future__ import annotations

import torch

from flame_llm.layers.sampler import apply_top_k_top_p

# random streams of one seeded request, so draws never share a generator key
DRAFT_STREAM, ACCEPT_STREAM, FINAL_STREAM = 1, 2, 3


def greedy_accept(target_ids: torch.Tensor, draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [B, K+1] (argmax per verified position), draft_ids [B, K] -> (accepted [B], next [B])."""
    match = (draft_ids == target_ids[:, :-1]).to(torch.int32).cumprod(dim=-1)
    num_accepted = match.sum(dim=-1).to(torch.int64)
    return num_accepted, target_ids.gather(1, num_accepted[:, None]).squeeze(1)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     uniforms: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, K+1, V], draft_probs [B, K, V], draft_ids [B, K] (drawn from draft_probs),
    uniforms [B, K] in [0, 1), noise [B, V] ~ Exp(1) -> (accepted count [B], emitted token [B])."""
    num_rows, k = draft_ids.shape
    ids = draft_ids[..., None]
    p_x = target_probs[:, :k].gather(-1, ids).squeeze(-1)
    q_x = draft_probs.gather(-1, ids).squeeze(-1)
    accept = uniforms * q_x < p_x  # u < p/q without dividing; q_x > 0 since x was drawn from q
    num_accepted = accept.to(torch.int32).cumprod(dim=-1).sum(dim=-1).to(torch.int64)
    rows = torch.arange(num_rows, device=draft_ids.device)
    p_at = target_probs[rows, num_accepted]
    q_at = draft_probs[rows, num_accepted.clamp(max=k - 1)] * (num_accepted < k)[:, None]  # bonus: q = 0
    residual = (p_at - q_at).clamp_min(0.0)
    # p == q leaves no residual mass; a rejection is then only a rounding artefact, so draw from p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    return num_accepted, (residual / noise).argmax(dim=-1)


def to_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor | None,
             top_ps: torch.Tensor | None) -> torch.Tensor:
    """The sampling distribution of each row: temperature, then top-k / top-p, then softmax."""
    scaled = logits.float() / temperatures[:, None]
    return apply_top_k_top_p(scaled, top_ks, top_ps).softmax(dim=-1)


def stream_key(seed: int, position: int, stream: int) -> int:
    """Generator key of one seeded draw: the request's seed, the output position, the stream."""
    return ((seed * 1_000_003 + position) * 4 + stream) % (2**63)


def fill_random(out: torch.Tensor, keys: list[int | None], kind: str) -> torch.Tensor:
    """Fill row r of out with Exp(1) ("exponential") or U[0, 1) ("uniform") draws, from a generator
    seeded with keys[r] where it is not None, else from the global generator."""
    if kind == "exponential":
        out.exponential_()
    else:
        out.uniform_()
    for row, key in enumerate(keys):
        if key is None:
            continue
        gen = torch.Generator(device=out.device).manual_seed(key)
        if kind == "exponential":
            out[row].exponential_(generator=gen)
        else:
            out[row].uniform_(generator=gen)
    return out
