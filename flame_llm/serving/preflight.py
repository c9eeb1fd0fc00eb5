"""Checks made before Ray or any actor starts: does every CPU shard's engine fit in this machine's memory?

A CPU shard holds its model's parameters (float32 unless the engine's dtype says otherwise) and its KV cache
(`cpu_kvcache_gib`, or `num_kvcache_blocks` blocks). A config meant for GPUs (Llama-3.1-8B: ~32 GB per shard in
float32) would otherwise load until the machine runs out of memory; this says so in one line instead."""
from __future__ import annotations

import os

from flame_llm.serving.service_config import ServiceConfig

GB = 1e9
GIB = 1 << 30
CPU_CONFIG_HINT = "configs/demo.yaml"  # the config to use on a CPU machine
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def num_parameters(hf_config) -> int:
    """Parameters of a Llama/Qwen3-style decoder from its config (embeddings, attention, MLP, norms, head)."""
    c = hf_config
    hidden, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    heads, kv_heads = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v projections
    mlp = 3 * hidden * c.intermediate_size
    per_layer = attention + mlp + 2 * hidden + (2 * head_dim if c.model_type == "qwen3" else 0)
    head = 0 if getattr(c, "tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + layers * per_layer + hidden + head


def kv_cache_bytes(hf_config, engine: dict, dtype_bytes: int) -> int:
    """The KV cache a CPU engine allocates: num_kvcache_blocks blocks when set, else what the runner sizes from
    cpu_kvcache_gib (kv_sizing.cpu_num_blocks: capped at what max_num_seqs sequences of max_model_len can hold)."""
    from flame_llm.config import EngineConfig
    from flame_llm.engine.kv_sizing import cpu_num_blocks, kv_block_bytes

    cfg = EngineConfig.from_kwargs(**engine)  # every field the engine dict leaves out takes its default
    cc, c = cfg.cache_config, hf_config
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_bytes = 1 if cc.kv_cache_dtype == "fp8" else dtype_bytes  # e4m3 K/V
    block_bytes = kv_block_bytes(c.num_hidden_layers, cc.block_size, kv_heads, head_dim, kv_bytes)
    blocks = cc.num_kvcache_blocks
    if blocks < 1:
        # max_model_len as the engine caps it (Config: at the model's positions)
        max_len = min(cfg.model_config.max_model_len, getattr(c, "max_position_embeddings", 1 << 62))
        blocks, _ = cpu_num_blocks(cc.cpu_kvcache_gib, block_bytes, cfg.scheduler_config.max_num_seqs, max_len,
                                   cc.block_size)
    return blocks * block_bytes


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def shard_memory_bytes(model_dir: str, engine: dict) -> tuple[int, str]:
    """(bytes one CPU shard needs, how that was reckoned)."""
    from flame_llm.config import load_hf_config

    hf = load_hf_config(model_dir)
    dtype = engine.get("dtype", "auto")
    dtype = "float32" if dtype == "auto" else dtype
    nbytes = DTYPE_BYTES[dtype]
    params = num_parameters(hf)
    kv = kv_cache_bytes(hf, engine, nbytes)
    return params * nbytes + kv, f"{params / 1e9:.2f}B parameters x {nbytes} bytes {dtype} + {kv / GB:.1f} GB KV cache"


def check_cpu_memory(cfg: ServiceConfig, model_dir: str, source: str = "this config",
                     available: int | None = None) -> None:
    """Raise RuntimeError (one line, naming the config to use on CPU) when the config's CPU shards together need
    more memory than this machine has available. Only for CPU shards on this machine (a locally started Ray
    without GPUs)."""
    engine = cfg.engine_kwargs()
    if cfg.ray.address is not None or str(engine.get("device", "auto")).startswith("cuda"):
        return
    from actors.pinning import local_gpu_uuids

    if local_gpu_uuids():
        return
    pc = cfg.placement
    shards = pc.cpu_shards if pc.num_shards == "auto" else pc.num_shards
    per_shard, how = shard_memory_bytes(model_dir, engine)
    available = available_memory_bytes() if available is None else available
    if per_shard * shards > available:
        raise RuntimeError(f"{source} needs ~{per_shard / GB:.1f} GB per CPU shard ({how}) x {shards} shards = "
                           f"{per_shard * shards / GB:.1f} GB, but this machine has {available / GB:.1f} GB "
                           f"available; on CPU use {CPU_CONFIG_HINT} (the tiny model), or a smaller model, dtype, "
                           "KV cache or shard count")
