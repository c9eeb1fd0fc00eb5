"""Weights from HF safetensors (one file or sharded with an index), or dummy random weights."""
from __future__ import annotations

import glob
import json
import logging
import os

import torch
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)
_IGNORED = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: 'weight_map' is missing or empty")
        files = sorted({os.path.join(model_dir, v) for v in weight_map.values()})
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{index} names {os.path.basename(path)!r}, which does not exist")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model directory {model_dir!r} has no *.safetensors files "
                                "(use load_format='dummy' for random weights)")
    return files


def load_model(model: nn.Module, model_dir: str, suffix_map: dict[str, str | None] | None = None) -> None:
    """Copy a checkpoint's tensors into `model`'s parameters (each through its weight_loader). suffix_map: a
    checkpoint name ending in a key ends in its value instead, or is skipped when the value is None (an FP8
    checkpoint's scale names: models/fp8_checkpoint.py). Tensors keep their dtype for float8 parameters."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    expected = set()
    for name in params:
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        shards = getattr(owner, "shard_offsets", None)
        expected.update((name, s) for s in shards) if shards else expected.add((name, None))
    seen: set[tuple[str, str | None]] = set()
    for path in safetensors_files(model_dir):
        with safe_open(path, "pt", device="cpu") as f:
            for ckpt_name in f.keys():
                if ckpt_name.endswith(_IGNORED):
                    continue
                target, shard = _renamed(ckpt_name, suffix_map or {}), None
                if target is None:
                    continue
                for hf_name, (ours, shard_id) in packed.items():
                    if f".{hf_name}." in target:
                        target, shard = target.replace(f".{hf_name}.", f".{ours}."), shard_id
                        break
                if target == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
                    continue  # tied: the embedding is the head
                param = params.get(target)
                if param is None:
                    logger.warning("%s: tensor %r has no matching parameter; ignored", path, ckpt_name)
                    continue
                tensor = f.get_tensor(ckpt_name)
                if param.dtype != torch.float8_e4m3fn:  # an fp8 parameter's loader checks what it gets
                    tensor = tensor.to(param.dtype)
                try:
                    param.weight_loader(param, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"{os.path.basename(path)}: tensor {ckpt_name!r}: {e}") from None
                seen.add((target, shard))
    missing = sorted(f"{n}" + (f"[{s}]" if s else "") for n, s in expected - seen)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint in {model_dir!r} is missing tensors: {shown}")


def _renamed(name: str, suffix_map: dict[str, str | None]) -> str | None:
    for old, new in suffix_map.items():
        if name.endswith(old):
            return None if new is None else name[: len(name) - len(old)] + new
    return name


def init_dummy(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks without downloads: norms at 1, the rest small and uniform."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.uniform_(-0.05, 0.05, generator=gen)
