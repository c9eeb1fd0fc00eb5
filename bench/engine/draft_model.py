"""A target/draft pair with dummy weights whose greedy agreement is set, for speculative benchmarks.

Random weights make a draft's acceptance meaningless (an unrelated 0.6B model never agrees with an 8B
one). Instead both models are shaped, in place and at full size (every matmul keeps its shape and
cost), so that their greedy next token is a fixed function of the current token:

- every layer's output projections (o_proj, down_proj) are scaled by LAYER_SCALE, so the residual
  stream stays close to the input token's embedding while attention and MLP still run in full;
- target: LM-head row pi(t) is the embedding of t, so its argmax after token t is pi(t) for a random
  permutation pi of the vocabulary (a dot product of a 4096-dim vector with itself beats every other
  row by a wide margin);
- draft: the same with sigma, where sigma = pi on a random fraction `agreement` of the tokens and
  pi(rho(t)) elsewhere (rho a cyclic shift of those tokens, so sigma(t) != pi(t) there).

The generated text walks pi's cycles, so each proposed position is accepted with probability
`agreement` independently; with K proposals the measured acceptance rate (accepted / proposed) is
(a + a^2 + ... + a^K) / K. The draft needs its own LM head: write_draft_config unties Qwen3-0.6B's
(the head is read once per step either way, so the draft's step cost is unchanged)."""
from __future__ import annotations

import json
import os

import torch

from bench import MODELS

LAYER_SCALE = 1e-3
CONFIGS = MODELS


def write_draft_config(dst: str, base: str = os.path.join(CONFIGS, "qwen3-0.6b")) -> str:
    """A model directory with base's config.json and an untied LM head (load_format='dummy')."""
    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    cfg["tie_word_embeddings"] = False
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return dst


@torch.no_grad()
def scale_layers(model, scale: float = LAYER_SCALE) -> None:
    """Shrink what each layer adds to the residual stream (call once per model)."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(scale)
        layer.mlp.down_proj.weight.mul_(scale)


def make_permutation(vocab_size: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randperm(vocab_size, generator=gen).to(device)


@torch.no_grad()
def set_head(model, next_token: torch.Tensor) -> None:
    """Make next_token[t] the greedy successor of token t: head row next_token[t] = embedding row t."""
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    if head.data_ptr() == embed.data_ptr():
        raise ValueError("the model ties its LM head to its embeddings; untie it (write_draft_config)")
    head[next_token] = embed


def draft_successor(pi: torch.Tensor, agreement: float, seed: int) -> torch.Tensor:
    """sigma: equal to pi on a random `agreement` fraction of tokens, different from pi on the rest."""
    if not 0.0 <= agreement <= 1.0:
        raise ValueError(f"agreement must be in [0, 1]; got {agreement!r}")
    v = pi.numel()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    disagree = torch.randperm(v, generator=gen)[: round((1.0 - agreement) * v)].to(pi.device)
    rho = torch.arange(v, device=pi.device)
    if disagree.numel() > 1:
        rho[disagree] = disagree.roll(1)
    return pi[rho]


def shape_pair(target, draft, agreement: float, seed: int = 0) -> torch.Tensor:
    """Shape a freshly built target and draft; returns pi (reuse it with set_agreement)."""
    scale_layers(target)
    scale_layers(draft)
    pi = make_permutation(target.lm_head.weight.shape[0], seed, target.lm_head.weight.device)
    set_head(target, pi)
    set_agreement(draft, pi, agreement, seed)
    return pi


def set_agreement(draft, pi: torch.Tensor, agreement: float, seed: int = 0) -> None:
    set_head(draft, draft_successor(pi.to(draft.lm_head.weight.device), agreement, seed + 1))
