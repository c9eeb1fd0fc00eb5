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
