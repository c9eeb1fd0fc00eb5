"""Startup compiles of the attention kernels, so no variant compiles just in time under load (issue 18: a Triton
variant a warmup never ran paused a step for seconds; an FA4 variant costs ~3 s). The ModelRunner calls one of
these after it allocates the KV cache; `layer` is any attention layer (they share shapes)."""
from __future__ import annotations

import logging
import time

from flame_llm.config import Config
from flame_llm.layers.attention import Attention

logger = logging.getLogger(__name__)


def warmup_fa4(config: Config, layer: Attention) -> None:
    """Compile every flash-attn-4 variant the engine's limits can reach (the dense ones too when
    fresh_prefill_backend is "fa4"), and our Triton kernel's decode-row variants."""
    from flame_llm.kernels import fa4_backend

    sc, t0 = config.scheduler_config, time.perf_counter()
    n = fa4_backend.warmup(layer.k_cache, layer.v_cache, layer.num_heads, layer.scale, sc.max_num_seqs,
                           sc.max_num_batched_tokens, config.model_config.max_model_len,
                           dense_fresh=config.runner_config.fresh_prefill_backend == "fa4")
    logger.info("flash-attn-4: %d kernel variants compiled in %.1fs", n, time.perf_counter() - t0)


def warmup_triton(config: Config, layer: Attention) -> None:
    """Compile every variant of our Triton attention that serving can reach, and FA4's dense variants when
    fresh_prefill_backend "fa4" sends fresh-only steps there."""
    from flame_llm.kernels.triton_attention import warmup_all_variants

    t0 = time.perf_counter()
    n = warmup_all_variants(layer.k_cache, layer.v_cache, layer.num_heads, layer.scale)
    logger.info("triton attention: %d variant launches in %.1fs", n, time.perf_counter() - t0)
    if config.runner_config.fresh_prefill_backend == "fa4":
        from flame_llm.kernels import fa4_backend

        sc, t0 = config.scheduler_config, time.perf_counter()
        n = fa4_backend.warmup_dense(layer.k_cache, layer.num_heads, layer.scale, sc.max_num_seqs,
                                     sc.max_num_batched_tokens, config.model_config.max_model_len)
        logger.info("flash-attn-4 dense: %d kernel variants compiled in %.1fs", n, time.perf_counter() - t0)


def tune_gemm_lt(config: Config, model, device, dtype) -> dict:
    """RunnerConfig.gemm_lt_min_tokens: the cuBLASLt plan of each projection shape, timed at step sizes from the
    flag's value up to max_num_batched_tokens (kernels/cublaslt.py). Before the KV cache takes the memory."""
    import torch

    from flame_llm.kernels.cublaslt import tune_linears, tune_ms
    from flame_llm.models.llama import gemm_lt_weights

    min_tokens = config.runner_config.gemm_lt_min_tokens
    if device.type != "cuda" or dtype != torch.bfloat16:
        raise ValueError(f"engine field 'gemm_lt_min_tokens' ({min_tokens}) runs cuBLASLt's bf16 GEMMs on CUDA; this "
                         f"engine runs {dtype} on {device.type} (set it to 0 there)")
    ms = tune_ms(min_tokens, config.scheduler_config.max_num_batched_tokens)
    t = time.perf_counter()
    plans, records = tune_linears(gemm_lt_weights(model), ms)
    for r in records:
        logger.info("cuBLASLt N=%d K=%d M=%d: %s (cuBLAS %.4f ms, fastest of %d bitwise-equal candidates %s %s ms)",
                    r["n"], r["k"], r["m"], r["used"], r["cublas_ms"], r["bitwise"], r["best"], r["best_ms"])
    used = sum(r["used"] != "cublas" for r in records)
    logger.info("cuBLASLt plans: %d of %d (shape, step size) pairs use a candidate over cuBLAS (%.1f s)", used,
                len(records), time.perf_counter() - t)
    return plans
