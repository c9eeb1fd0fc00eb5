"""Config parsing that needs no config class (flame_llm/config.py imports it; its names stay importable from
there): a model directory's config.json, its revision name, --engine-json's object."""
from __future__ import annotations

import json
import os

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
ENGINE_FIELD = {"where": "engine field"}  # "engine field 'max_num_seqs' must be ...": LLM(...), --engine-json, YAML


def load_hf_config(model: str) -> PretrainedConfig:
    """Read config.json of a model directory, with errors that name what is wrong."""
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model directory {model!r} has no config.json")
    with open(path) as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError(f"{path}: 'architectures' is missing; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: architecture {archs[0]!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return AutoConfig.from_pretrained(model)


def json_object(text: str, flag: str) -> dict:
    """The JSON object `flag` (e.g. --engine-json) gives; ValueError names the flag."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{flag} must be a JSON object of flame_llm Config fields; got {text[:80]!r}")
    return obj


def default_model_revision(model: str) -> str:
    """A stable name of the weights: the directory's basename plus its config.json contents hash."""
    import xxhash

    with open(os.path.join(model, "config.json"), "rb") as f:
        digest = xxhash.xxh64(f.read()).hexdigest()
    return f"{os.path.basename(os.path.normpath(model))}@{digest[:12]}"
