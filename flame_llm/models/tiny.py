"""Tiny random-weight checkpoints written with transformers' save_pretrained: the embedded default
model for the demo (with a tokenizer and a chat template trained here: flame_llm/models/tiny_tokenizer.py), and
the fixtures the tests load through our real loader."""
from __future__ import annotations

import os

import torch

TINY_DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "flame_llm", "tiny-llama")
TINY_VOCAB_SIZE = 512  # the default model's vocabulary; its tokenizer is trained to exactly this size


def make_tiny_model(path: str, arch: str = "llama", vocab_size: int = TINY_VOCAB_SIZE, seed: int = 0,
                    num_layers: int = 2, max_position_embeddings: int = 4096,
                    sharded: bool = False, std: float = 0.35, tokenizer: bool = False) -> str:
    """Write a float32 random checkpoint (with `tokenizer`: and the tiny tokenizer beside it). A large init
    spread keeps greedy outputs varied from token to token (a model that repeats one token hides position and
    cache bugs)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=max_position_embeddings, initializer_range=std,
                  bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    if arch == "llama":
        cfg = LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
        cls = LlamaForCausalLM
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(f"arch must be 'llama' or 'qwen3'; got {arch!r}")
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():  # norms at 1 would leave the spread to the projections alone; vary them too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    # write beside the target and rename into place, so two processes creating it never see half a model
    import shutil
    import tempfile

    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tiny-")
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="100KB" if sharded else "10GB")
    if tokenizer:
        from flame_llm.models.tiny_tokenizer import save_tokenizer

        save_tokenizer(tmp, vocab_size)
    try:
        if os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)
        os.rename(tmp, path)
    except OSError:  # another process finished first (or the target already has files): keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise
    return path


def resolve_model(model: str) -> str:
    """A model directory: `model` itself, or for "tiny" the embedded default (created on first use)."""
    return ensure_tiny_default() if model == "tiny" else model


def ensure_tiny_default(path: str | None = None) -> str:
    """The demo's embedded default model (at `path`, default TINY_DEFAULT_DIR), created once on first use; a
    cached copy without the current tokenizer (made before it existed, or by another recipe) gets it added, the
    weights untouched."""
    from flame_llm.models.tiny_tokenizer import has_current_tokenizer, save_tokenizer

    path = path or TINY_DEFAULT_DIR
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny_model(path, "llama", vocab_size=TINY_VOCAB_SIZE, tokenizer=True)
    if not has_current_tokenizer(path, TINY_VOCAB_SIZE):
        save_tokenizer(path, TINY_VOCAB_SIZE)
    return path
