"""The service's memory preflight charges a CPU shard the KV cache its engine really allocates."""
import pytest

from flame_llm import LLM
from flame_llm.config import load_hf_config
from flame_llm.serving.preflight import kv_cache_bytes


@pytest.mark.parametrize("engine", [
    dict(block_size=16, max_num_seqs=2, max_model_len=256),  # capped at max_num_seqs x max_model_len
    dict(block_size=16, max_num_seqs=64, max_model_len=256, cpu_kvcache_gib=0.001),  # the budget caps it
    dict(block_size=16, num_kvcache_blocks=100),  # taken as given
    # kv_cache_dtype fp8 (issue 40): one byte a value, so the budget holds 4x the blocks of fp32
    dict(block_size=16, max_num_seqs=64, max_model_len=256, cpu_kvcache_gib=0.001, kv_cache_dtype="fp8"),
    dict(block_size=16, num_kvcache_blocks=100, kv_cache_dtype="fp8"),
])
def test_preflight_kv_bytes_are_what_the_cpu_engine_allocates(tiny_llama, engine):
    runner = LLM(tiny_llama, device="cpu", **engine).engine.model_runner
    allocated = runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert kv_cache_bytes(load_hf_config(tiny_llama), engine, dtype_bytes=4) == allocated


def test_preflight_caps_max_model_len_at_the_models_positions(tiny_llama):
    hf = load_hf_config(tiny_llama)
    engine = dict(block_size=16, max_num_seqs=1, max_model_len=10 * hf.max_position_embeddings)
    runner = LLM(tiny_llama, device="cpu", **engine).engine.model_runner
    assert kv_cache_bytes(hf, engine, 4) == runner.kv_cache.numel() * runner.kv_cache.element_size()
