import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from flame_llm import LLM, SamplingParams
from flame_llm.config import Config


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_directory():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Config.from_kwargs("/nonexistent/model")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Config.from_kwargs(str(tmp_path))


def test_unsupported_and_missing_architecture(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="not supported"):
        Config.from_kwargs(d)
    cfg.pop("architectures")
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="architectures"):
        Config.from_kwargs(d)


def test_no_safetensors(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(d)


def test_missing_tensor(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: model.layers.1.self_attn.qkv_proj.weight\[k\]"):
        LLM(d)


def test_misshaped_tensor(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        LLM(d)


def test_sharded_index_pointing_to_missing_file(tiny_qwen3, tmp_path):
    d = copy_model(tiny_qwen3, tmp_path / "m")
    shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(d, shard))
    with pytest.raises(FileNotFoundError, match=shard):
        LLM(d)


def test_dummy_weights_from_config_alone(tiny_llama, tmp_path):
    d = tmp_path / "cfg-only"
    d.mkdir()
    shutil.copy(os.path.join(tiny_llama, "config.json"), d / "config.json")
    out = LLM(str(d), load_format="dummy", block_size=16).generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.output_token_ids) == 4


@pytest.mark.parametrize("field,value,match", [
    ("block_size", 24, "block_size"), ("dtype", "int8", "dtype"), ("load_format", "gguf", "load_format"),
    ("attention_backend", "xformers", "attention_backend"),
    ("max_num_seqs", 0, "max_num_seqs"),
    ("max_num_batched_tokens", 100, "max_num_batched_tokens"), ("gpu_memory_utilization", 1.5,
                                                                "gpu_memory_utilization"),
    ("max_num_seqs", True, "max_num_seqs"), ("num_kvcache_blocks", 0, "num_kvcache_blocks"),
    ("cpu_kvcache_gib", 0, "cpu_kvcache_gib"), ("mixed_decode_attention", "cudnn", "mixed_decode_attention"),
    ("nonsense", 1, r"unknown config field\(s\) \['nonsense'\]; known: .*max_num_seqs"),
])
def test_bad_config_fields(tiny_llama, field, value, match):
    # chunked prefill off: a step budget below max_model_len is then refused (it is accepted with the default, on)
    with pytest.raises(ValueError, match=match):
        Config.from_kwargs(tiny_llama, max_model_len=512, enable_chunked_prefill=False, **{field: value})


def test_a_step_budget_below_max_model_len_needs_chunked_prefill_which_is_the_default(tiny_llama):
    cfg = Config.from_kwargs(tiny_llama, max_model_len=512, max_num_batched_tokens=100)
    assert cfg.scheduler_config.enable_chunked_prefill and cfg.scheduler_config.max_num_batched_tokens == 100


def test_config_groups_and_flat_names_round_trip(tiny_llama):
    cfg = Config.from_kwargs(tiny_llama, max_num_seqs=7, block_size=32, enforce_eager=True, enable_lru=True)
    assert (cfg.scheduler_config.max_num_seqs, cfg.cache_config.block_size, cfg.runner_config.enforce_eager,
            cfg.cache_config.enable_lru) == (7, 32, True, True)
    flat = cfg.to_kwargs()
    assert flat["model"] == tiny_llama and "hf_config" not in flat
    again = Config.from_kwargs(flat.pop("model"), **flat)
    assert again.to_kwargs() == cfg.to_kwargs()


def test_shipped_benchmark_configs_parse():
    root = os.path.join(os.path.dirname(__file__), "..", "configs", "models")
    for name in ("llama-3.1-8b", "qwen3-0.6b", "qwen3-8b"):
        cfg = Config.from_kwargs(os.path.join(root, name), load_format="dummy", max_model_len=32768,
                                 max_num_batched_tokens=32768)
        assert cfg.model_config.hf_config.num_key_value_heads == 8
