"""Engine configuration, in vLLM's groups (model, cache, scheduler, runner, speculative). Every
scheduler/cache feature is a flag here. Field names are unique across groups, so callers pass them flat:
`Config.from_kwargs(model, max_num_seqs=8, enable_chunked_prefill=True)`."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
ATTENTION_BACKENDS = ("auto", "fa4", "triton", "flash_attn", "torch")
FRESH_PREFILL_BACKENDS = ("triton", "sdpa", "cudnn", "flash", "efficient", "varlen", "fa4")
# RunnerConfig.gemm_epilogues: op -> the GEMMs that can carry it in their epilogue (kernels/gemm_epilogue.py)
GEMM_EPILOGUE_IMPLS = {"swiglu": ("triton", "quack"), "residual": ("cublas", "triton", "quack")}


def parse_gemm_epilogues(spec: str) -> dict[str, str]:
    """{op: impl} of a comma-separated OP=IMPL spec; ValueError names the field, the part and what is allowed."""
    if not isinstance(spec, str):
        raise ValueError(f"config field 'gemm_epilogues' must be a string; got {spec!r}")
    out: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        op, _, impl = part.partition("=")
        if impl not in GEMM_EPILOGUE_IMPLS.get(op, ()) or op in out:
            known = "; ".join(f"{o}=" + "|".join(i) for o, i in GEMM_EPILOGUE_IMPLS.items())
            raise ValueError(f"config field 'gemm_epilogues': {part!r} is not one of {known} (each op once)")
        out[op] = impl
    return out


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
class ModelConfig:
    model: str  # a directory with config.json (and safetensors unless load_format is "dummy")
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights from config.json)
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU; or "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    max_model_len: int = 4096  # capped at the model's max_position_embeddings
    seed: int = 0
    model_revision: str = ""  # salts prefix identity in the router; default: derived from the model dir
    eos_token_ids: tuple[int, ...] = ()  # default: the model's
    hf_config: PretrainedConfig | None = field(default=None, repr=False)  # read from config.json


@dataclass(slots=True)
class CacheConfig:
    # 128: FA4 loads whole 128-key pages with TMA (other page sizes gather rows); on the H200 the reuse trace's
    # attention took 3.28 s at 128 vs 3.56 s at 256 (bench/RESULTS.md, issue 11)
    block_size: int = 128
    num_kvcache_blocks: int = -1  # -1: size from gpu_memory_utilization (GPU) or cpu_kvcache_gib (CPU)
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_gib: float = 1.0
    enable_prefix_caching: bool = True
    enable_lru: bool = False  # free cached blocks form an LRU; uncached ones are reused first
    # blocks become prefix-cache hits when the step that computes them is scheduled, so a request admitted in
    # the same step shares them instead of computing them again (off: only after that step ran)
    enable_same_step_prefix_sharing: bool = True


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    # each feature off reproduces the original two-phase scheduler exactly
    enable_chunked_prefill: bool = False
    enable_cache_aware_schedule: bool = False
    cache_aware_window: int = 64  # waiting requests reordered by cached-prefix length
    cache_aware_max_skips: int = 16  # aging: a request passed over this many times goes first
    # a waiting request whose next uncached block a running sequence is computing waits for it
    enable_prefix_dedup: bool = False
    # launch step N+1 before reading step N's tokens, so the host prepares a step while the GPU runs the last
    # one. None: on with CUDA (off on CPU, where nothing overlaps, and with speculative decoding)
    async_scheduling: bool | None = None


@dataclass(slots=True)
class RunnerConfig:
    enforce_eager: bool = False  # no CUDA graphs
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
    gemm_epilogues: str = ""  # ops fused into GEMM epilogues, e.g. "swiglu=triton,residual=cublas"


@dataclass(slots=True)
class SpeculativeConfig:
    speculative_model: str | None = None  # the draft model's directory
    num_speculative_tokens: int = 0
    speculative_max_batch_size: int = 8  # speculation turns itself off above this running batch


GROUPS = {"model_config": ModelConfig, "cache_config": CacheConfig, "scheduler_config": SchedulerConfig,
          "runner_config": RunnerConfig, "speculative_config": SpeculativeConfig}
# every field name is unique across the groups: the flat keyword API (LLM(model, max_num_seqs=...), the
# service YAML's engine section, --engine-json) names fields without their group
_GROUP_OF = {f.name: g for g, cls in GROUPS.items() for f in fields(cls)}
FIELD_NAMES = tuple(name for name in _GROUP_OF if name != "hf_config")


@dataclass(slots=True)
class Config:
    """The engine's configuration in vLLM's groups. Build it with `Config.from_kwargs(model, **fields)`."""
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner_config: RunnerConfig = field(default_factory=RunnerConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> Config:
        """A config from flat field names (any group); ValueError names an unknown one."""
        unknown = sorted(k for k in kwargs if k not in _GROUP_OF or k in ("model", "hf_config"))
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}; known: {', '.join(sorted(FIELD_NAMES))}")
        parts: dict[str, dict] = {g: {} for g in GROUPS}
        for k, v in kwargs.items():
            parts[_GROUP_OF[k]][k] = v
        try:
            groups = {g: GROUPS[g](**parts[g]) for g in GROUPS if g != "model_config"}
            return cls(ModelConfig(model, **parts["model_config"]), **groups)
        except TypeError as e:  # a positional mix-up in a caller; fields are checked in __post_init__
            raise ValueError(f"config: {e}") from None

    def to_kwargs(self) -> dict:
        """The flat fields (model included, hf_config left out): from_kwargs(**to_kwargs()) rebuilds it."""
        out = {}
        for g in GROUPS:
            group = getattr(self, g)
            out.update({f.name: getattr(group, f.name) for f in fields(group) if f.name != "hf_config"})
        return out

    def __post_init__(self) -> None:
        m, c, s, r, sp = (self.model_config, self.cache_config, self.scheduler_config, self.runner_config,
                          self.speculative_config)
        m.hf_config = load_hf_config(m.model)
        _check(m.load_format in ("auto", "dummy"), "load_format", "one of 'auto', 'dummy'", m.load_format)
        _check(m.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
               "one of 'auto', 'float32', 'bfloat16', 'float16'", m.dtype)
        _check(_int(m.max_model_len) and m.max_model_len >= 2, "max_model_len", "an integer >= 2", m.max_model_len)
        _check(_int(m.seed) and m.seed >= 0, "seed", "an integer >= 0", m.seed)
        _check(r.attention_backend in ATTENTION_BACKENDS, "attention_backend", f"one of {ATTENTION_BACKENDS}",
               r.attention_backend)
        _check(r.mixed_decode_attention in ("triton", "fa4"), "mixed_decode_attention", "'triton' or 'fa4'",
               r.mixed_decode_attention)
        _check(r.fresh_prefill_backend in FRESH_PREFILL_BACKENDS, "fresh_prefill_backend",
               f"one of {FRESH_PREFILL_BACKENDS}", r.fresh_prefill_backend)
        parse_gemm_epilogues(r.gemm_epilogues)  # ValueError names the field and the allowed values
        _check(_int(c.block_size) and c.block_size >= 16 and c.block_size % 16 == 0, "block_size",
               "a positive multiple of 16", c.block_size)
        _check(_int(c.num_kvcache_blocks) and (c.num_kvcache_blocks == -1 or c.num_kvcache_blocks >= 1),
               "num_kvcache_blocks", "-1 (sized from memory) or an integer >= 1", c.num_kvcache_blocks)
        _check(_num(c.gpu_memory_utilization) and 0.0 < c.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
               "in (0, 1]", c.gpu_memory_utilization)
        _check(_num(c.cpu_kvcache_gib) and c.cpu_kvcache_gib > 0, "cpu_kvcache_gib", "> 0", c.cpu_kvcache_gib)
        _check(_int(s.max_num_seqs) and s.max_num_seqs >= 1, "max_num_seqs", "an integer >= 1", s.max_num_seqs)
        _check(_int(s.cache_aware_window) and s.cache_aware_window >= 1, "cache_aware_window", "an integer >= 1",
               s.cache_aware_window)
        _check(_int(s.cache_aware_max_skips) and s.cache_aware_max_skips >= 0, "cache_aware_max_skips",
               "an integer >= 0", s.cache_aware_max_skips)
        speculative = sp.speculative_model is not None or sp.num_speculative_tokens != 0
        _check(_int(sp.num_speculative_tokens) and sp.num_speculative_tokens >= 0, "num_speculative_tokens",
               "an integer >= 0", sp.num_speculative_tokens)
        _check(not (s.async_scheduling and speculative), "async_scheduling",
               "off (None or False) with speculative decoding", s.async_scheduling)
        max_pos = getattr(m.hf_config, "max_position_embeddings", m.max_model_len)
        m.max_model_len = min(m.max_model_len, max_pos)
        _check(_int(s.max_num_batched_tokens) and s.max_num_batched_tokens >= s.max_num_seqs,
               "max_num_batched_tokens", f">= max_num_seqs ({s.max_num_seqs})", s.max_num_batched_tokens)
        if not s.enable_chunked_prefill:
            _check(s.max_num_batched_tokens >= m.max_model_len, "max_num_batched_tokens",
                   f">= max_model_len ({m.max_model_len}) unless enable_chunked_prefill", s.max_num_batched_tokens)
        eos = getattr(m.hf_config, "eos_token_id", None)
        if not m.eos_token_ids:
            m.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if not m.model_revision:
            m.model_revision = default_model_revision(m.model)

    @property
    def speculative(self) -> bool:
        sp = self.speculative_config
        return sp.speculative_model is not None or sp.num_speculative_tokens != 0


def engine_fields_from_json(text: str, flag: str = "--engine-json") -> dict:
    """A JSON object of Config fields (flat names), as command lines take it; ValueError names the flag and,
    for an unknown field, the known ones. The values are checked when a Config is built from them."""
    try:
        fields_ = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(fields_, dict):
        raise ValueError(f"{flag} must be a JSON object of flame_llm Config fields; got {text[:80]!r}")
    unknown = sorted(k for k in fields_ if k not in FIELD_NAMES or k == "model")
    if unknown:
        raise ValueError(f"{flag}: unknown config field(s) {unknown}; known: {', '.join(sorted(FIELD_NAMES))}")
    return fields_


def default_model_revision(model: str) -> str:
    """A stable name of the weights: the directory's basename plus its config.json contents hash."""
    import xxhash

    with open(os.path.join(model, "config.json"), "rb") as f:
        digest = xxhash.xxh64(f.read()).hexdigest()
    return f"{os.path.basename(os.path.normpath(model))}@{digest[:12]}"


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check(ok: bool, name: str, limit: str, value: object) -> None:
    if not ok:
        raise ValueError(f"config field {name!r} must be {limit}; got {value!r}")
