"""Llama 3.x and Qwen3 decoders (Qwen3 = Llama + per-head q/k RMSNorm, usually tied embeddings)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flame_llm.layers.attention import Attention
from flame_llm.layers.layers import (
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    default_weight_loader,
    rope_parameters,
)


class DecoderAttention(nn.Module):
    def __init__(self, cfg, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias)
        self.rotary_emb = RotaryEmbedding(self.head_dim, cfg.max_position_embeddings, rope_parameters(cfg))
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o_proj(attention(x))."""
        q, k, v = self._qkv(positions, x)
        return self.o_proj(self.attn(q, k, v).flatten(1, -1))

    def forward_kept(self, positions: torch.Tensor, x: torch.Tensor, keep_rows: torch.Tensor) -> torch.Tensor | None:
        """Store the K/V of every row of x, then o_proj(attention) of the rows keep_rows only; None when keep_rows
        is empty (the store alone)."""
        q, k, v = self._qkv(positions, x)
        o = self.attn.forward_kept(q[keep_rows], k, v)
        return None if o.shape[0] == 0 else self.o_proj(o.flatten(1, -1))

    def _qkv(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported; supported: 'silu'")
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": cfg.intermediate_size,
                                                           "up": cfg.intermediate_size}, bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up)."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, qk_norm)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def forward_kept(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                     keep_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """forward for the rows keep_rows only, after storing every row's K/V (prune_last_layer); None when
        keep_rows is empty."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        out = self.self_attn.forward_kept(positions, hidden, keep_rows)
        if out is None:
            return None
        out, residual = self.post_attention_layernorm(out, residual[keep_rows])
        return self.mlp(out), residual


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class DecoderModel(nn.Module):
    def __init__(self, cfg, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, qk_norm) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep_rows: torch.Tensor | None = None,
                ) -> torch.Tensor:
        """Hidden states of every row, or with keep_rows of those rows only: the last layer stores every row's
        K/V, then runs on keep_rows alone (prune_last_layer; no later token needs its other rows' output)."""
        hidden, residual = self.embed_tokens(input_ids), None
        last = self.layers[-1] if keep_rows is not None else None
        for layer in self.layers:
            if layer is last:
                out = layer.forward_kept(positions, hidden, residual, keep_rows)
                if out is None:  # nothing sampled: the K/V store was all the last layer had to do
                    return hidden.new_empty((0, hidden.shape[-1]))
                hidden, residual = out
                break
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    # HF checkpoint name -> (our parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg) -> None:
        super().__init__()
        self.model = DecoderModel(cfg, self.qk_norm)
        self.lm_head = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep_rows: torch.Tensor | None = None,
                ) -> torch.Tensor:
        return self.model(input_ids, positions, keep_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.weight).float()


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


MODELS = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM}
