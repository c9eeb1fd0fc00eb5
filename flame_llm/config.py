"""Engine configuration. One flat dataclass; every scheduler/cache feature is a flag here."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
ATTENTION_BACKENDS = ("auto", "fa4", "triton", "flash_attn", "torch")
FRESH_PREFILL_BACKENDS = ("triton", "sdpa", "cudnn", "flash", "efficient", "varlen")


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


@dataclass(slots=True)
class Config:
    model: str
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights from config.json)
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU; or "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    max_model_len: int = 4096
    # 128: FA4 loads whole 128-key pages with TMA (other page sizes gather rows); on the H200 the reuse trace's
    # attention took 3.28 s at 128 vs 3.56 s at 256 (bench/RESULTS.md, issue 11)
    block_size: int = 128
    num_kvcache_blocks: int = -1  # -1: size from gpu_memory_utilization (GPU) or cpu_kvcache_gib (CPU)
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_gib: float = 1.0
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    fused_ops: bool = True  # Triton RMSNorm(+residual), RoPE and SiLU-mul on CUDA; torch ops elsewhere
    # "auto": on CUDA, flash-attn-4 for steps with prefill tokens when it imports on SM90+ (decode-only steps
    # on our Triton kernel), else ours for every step; torch on CPU. Or "fa4" | "triton" | "flash_attn" | "torch"
    attention_backend: str = "auto"
    # fa4 backend: a mixed step's single-token (decode) rows go to our Triton decode kernel ("triton") or stay
    # in FA4's varlen call with the prefill rows ("fa4")
    mixed_decode_attention: str = "triton"
    # fresh-only prefill steps on the triton backend: our kernel, or torch SDPA ("sdpa": cuDNN on the H200,
    # 513 vs 407 TFLOP/s for dense 8K causal) on the fresh K/V; SDPA may build a plan per new length
    fresh_prefill_backend: str = "triton"
    # launch step N+1 before reading step N's tokens, so the host prepares a step while the GPU runs the last
    # one. None: on with CUDA (off on CPU, where nothing overlaps, and with speculative decoding)
    async_scheduling: bool | None = None
    # scheduler / cache features: each off reproduces the original two-phase scheduler exactly
    enable_chunked_prefill: bool = False
    enable_lru: bool = False
    enable_cache_aware_schedule: bool = False
    cache_aware_window: int = 64  # waiting requests reordered by cached-prefix length
    cache_aware_max_skips: int = 16  # aging: a request passed over this many times goes first
    # a waiting request whose next uncached block a running sequence is computing waits for it
    enable_prefix_dedup: bool = False
    # blocks become prefix-cache hits when the step that computes them is scheduled, so a request admitted in
    # the same step shares them instead of computing them again (off: only after that step ran)
    enable_same_step_prefix_sharing: bool = True
    # speculative decoding
    speculative_model: str | None = None
    num_speculative_tokens: int = 0
    speculative_max_batch_size: int = 8  # speculation turns itself off above this running batch
    seed: int = 0
    model_revision: str = ""  # salts prefix identity in the router; default: derived from the model dir
    hf_config: PretrainedConfig | None = field(default=None, repr=False)
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.hf_config = load_hf_config(self.model)
        _check(self.load_format in ("auto", "dummy"), "load_format", "one of 'auto', 'dummy'", self.load_format)
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
               "one of 'auto', 'float32', 'bfloat16', 'float16'", self.dtype)
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", f"one of {ATTENTION_BACKENDS}",
               self.attention_backend)
        _check(self.mixed_decode_attention in ("triton", "fa4"), "mixed_decode_attention", "'triton' or 'fa4'",
               self.mixed_decode_attention)
        _check(self.fresh_prefill_backend in FRESH_PREFILL_BACKENDS, "fresh_prefill_backend",
               f"one of {FRESH_PREFILL_BACKENDS}", self.fresh_prefill_backend)
        _check(self.block_size >= 16 and self.block_size % 16 == 0, "block_size",
               "a positive multiple of 16", self.block_size)
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.max_model_len >= 1, "max_model_len", ">= 1", self.max_model_len)
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "in (0, 1]",
               self.gpu_memory_utilization)
        _check(self.num_speculative_tokens >= 0, "num_speculative_tokens", ">= 0", self.num_speculative_tokens)
        _check(not (self.async_scheduling and (self.speculative_model or self.num_speculative_tokens)),
               "async_scheduling", "off (None or False) with speculative decoding", self.async_scheduling)
        _check(self.cache_aware_window >= 1, "cache_aware_window", ">= 1", self.cache_aware_window)
        max_pos = getattr(self.hf_config, "max_position_embeddings", self.max_model_len)
        self.max_model_len = min(self.max_model_len, max_pos)
        if not self.enable_chunked_prefill:
            _check(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                   f">= max_model_len ({self.max_model_len}) unless enable_chunked_prefill",
                   self.max_num_batched_tokens)
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
               f">= max_num_seqs ({self.max_num_seqs})", self.max_num_batched_tokens)
        eos = getattr(self.hf_config, "eos_token_id", None)
        if not self.eos_token_ids:
            self.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if not self.model_revision:
            self.model_revision = default_model_revision(self.model)


def max_prompt_tokens(max_model_len: int) -> int:
    """The longest prompt an engine of this max_model_len accepts: it must leave room for one output token.
    The one rule: the engine, the wire decoder and the HTTP front door all apply it."""
    return max_model_len - 1


def default_model_revision(model: str) -> str:
    """A stable name of the weights: the directory's basename plus its config.json contents hash."""
    import xxhash

    with open(os.path.join(model, "config.json"), "rb") as f:
        digest = xxhash.xxh64(f.read()).hexdigest()
    return f"{os.path.basename(os.path.normpath(model))}@{digest[:12]}"


def _check(ok: bool, name: str, limit: str, value: object) -> None:
    if not ok:
        raise ValueError(f"config field {name!r} must be {limit}; got {value!r}")
