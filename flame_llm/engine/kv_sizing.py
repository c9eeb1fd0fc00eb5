"""How many KV blocks an engine's pool holds: one rule, used by the ModelRunner when it allocates the pool and
by the service's preflight (flame_llm/serving/preflight.py) when it checks that CPU shards fit in memory."""
from __future__ import annotations

from flame_llm.limits import max_kv_blocks_in_use

GIB = 1 << 30


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one block of the pool: K and V of every layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def cpu_num_blocks(cpu_kvcache_gib: float, block_bytes: int, max_num_seqs: int, max_model_len: int,
                   block_size: int) -> tuple[int, str]:
    """A CPU pool: what cpu_kvcache_gib holds, but no more than the running sequences can use at once (the host's
    memory is held from startup, idle or not). block_bytes: per block, every pool indexed by the same block ids
    (a speculative draft's too). Returns (blocks, why that many)."""
    budget = int(cpu_kvcache_gib * GIB) // block_bytes
    usable = max_kv_blocks_in_use(max_num_seqs, max_model_len, block_size)
    if usable < budget:
        return usable, f"max_num_seqs x max_model_len (cpu_kvcache_gib={cpu_kvcache_gib} would hold {budget} blocks)"
    return budget, f"cpu_kvcache_gib={cpu_kvcache_gib}"


def profile_num_blocks(model, config, device, block_bytes: int) -> int:
    """A GPU pool: the peak activation memory of a full-budget prefill of `model`, then the rest of
    gpu_memory_utilization for KV blocks of block_bytes each (every pool indexed by the same block ids)."""
    import torch  # here, not at the top: the preflight imports this module without torch

    from flame_llm.kernels.metadata import AttentionMetadata, set_context

    sc = config.scheduler_config
    with torch.inference_mode():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        m = config.model_config.max_model_len
        n = min(sc.max_num_batched_tokens, m * sc.max_num_seqs)
        lens = [m] * (n // m) + ([n % m] if n % m else [])
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
        positions = torch.cat([torch.arange(length, device=device) for length in lens])
        set_context(AttentionMetadata(cu, cu[1:] - cu[:-1], torch.zeros(len(lens), 1, dtype=torch.int32,
                    device=device), torch.full((n,), -1, dtype=torch.int64, device=device),
                    max(lens), max(lens), fresh_only=True))
        try:
            hidden = model(torch.zeros(n, dtype=torch.int64, device=device), positions)
            model.compute_logits(hidden[cu[1:] - 1])
        finally:
            set_context(None)
        torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used = total - free
    peak, current = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    budget = total * config.cache_config.gpu_memory_utilization - used - (peak - current)
    return int(budget) // block_bytes
