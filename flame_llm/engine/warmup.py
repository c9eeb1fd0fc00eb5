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
    """Compile every flash-attn-4 variant the engine's limits can reach, and our Triton kernel's decode-row
    variants."""
    from flame_llm.kernels import fa4_backend

    sc, t0 = config.scheduler_config, time.perf_counter()
    n = fa4_backend.warmup(layer.k_cache, layer.v_cache, layer.num_heads, layer.scale, sc.max_num_seqs,
                           sc.max_num_batched_tokens, config.model_config.max_model_len)
    logger.info("flash-attn-4: %d kernel variants compiled in %.1fs", n, time.perf_counter() - t0)


def warmup_triton(config: Config, layer: Attention) -> None:
    """Compile every variant of our Triton attention that serving can reach."""
    from flame_llm.kernels.triton_attention import warmup_all_variants

    t0 = time.perf_counter()
    n = warmup_all_variants(layer.k_cache, layer.v_cache, layer.num_heads, layer.scale)
    logger.info("triton attention: %d variant launches in %.1fs", n, time.perf_counter() - t0)
