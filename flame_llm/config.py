"""Engine configuration, in vLLM's groups (model, cache, scheduler, runner, speculative). Every
scheduler/cache feature is a flag here. Field names are unique across groups, so callers pass them flat:
`Config.from_kwargs(model, max_num_seqs=8, enable_chunked_prefill=True)`."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from transformers import PretrainedConfig

# parsing that needs no config class lives in config_parse; these names stay importable from here
from flame_llm.config_parse import ENGINE_FIELD as _F
from flame_llm.config_parse import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from flame_llm.config_parse import default_model_revision, json_object, load_hf_config
from flame_llm.prefix import DEFAULT_BLOCK_SIZE
from flame_llm.validate import check, check_bool, check_choice, check_int, check_number, check_str, is_int

LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "fp8")  # ModelConfig.quantization
KV_CACHE_DTYPES = ("auto", "fp8")  # CacheConfig.kv_cache_dtype
ATTENTION_BACKENDS = ("auto", "fa4", "triton", "flash_attn", "torch")
MIXED_DECODE_ATTENTION = ("triton", "fa4")
# RunnerConfig.cuda_graph_mixed_tokens's default with CUDA graphs: vLLM's largest captured size; on the H200 a step
# of a 64-token question among 4 decodes took 21.7 ms eager, 6.7 ms replayed (bench/RESULTS.md, mixed-step graphs)
MIXED_GRAPH_TOKENS = 512
HANDOFF_WAIT_MAX_MS = 10.0  # SchedulerConfig.handoff_wait_ms's upper bound: two GIL switch intervals


@dataclass(slots=True)
class ModelConfig:
    model: str  # a directory with config.json (and safetensors unless load_format is "dummy")
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights from config.json)
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU; or "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    max_model_len: int = 4096  # capped at the model's max_position_embeddings
    seed: int = 0  # of sampling without a request seed, and of dummy weights
    model_revision: str = ""  # salts prefix identity in the router; default: derived from the model dir
    eos_token_ids: tuple[int, ...] = ()  # default: the model's
    # "fp8": W8A8 decoder projections, e4m3 weights with per-output-channel scales (quantized at load, or read
    # from a compressed-tensors / HF "fp8" checkpoint) and per-token activation scales at run time (layers/fp8.py)
    quantization: str | None = None  # null (off) | fp8
    # on since session 23: equal to the unfused chain on the GPU (tests/test_gpu_fp8_fused.py, session 20) and
    # 1.051x its req/s on the no-reuse trace (offline engine, H100, bench/RESULTS.md); acts only with fp8
    fp8_fused_quant: bool = True  # fp8: RMSNorm / SiLU-mul write the e4m3 inputs + scales (kernels/fp8_fused.py)
    fp8_small_m_gemv: int = 0  # fp8: steps of <= this many rows (<= 64) run W8A16 (kernels/fp8_gemv.py); 0: off
    tokenizer: str = ""  # an HF tokenizer directory or "tiny" (models/tokenizer.py); "": the model directory's
    hf_config: PretrainedConfig | None = field(default=None, repr=False)  # read from config.json

    def __post_init__(self) -> None:
        check_str("model", self.model, empty=True, **_F)
        check_choice("load_format", self.load_format, LOAD_FORMATS, **_F)
        check_choice("dtype", self.dtype, DTYPES, **_F)
        check_str("device", self.device, what="a device ('auto', 'cpu', 'cuda' or 'cuda:N')", **_F)
        check_int("max_model_len", self.max_model_len, 2, **_F)
        check_int("seed", self.seed, 0, **_F)
        check_str("model_revision", self.model_revision, empty=True, **_F)
        check_choice("quantization", self.quantization, QUANTIZATIONS, **_F)
        check_bool("fp8_fused_quant", self.fp8_fused_quant, **_F)
        check_int("fp8_small_m_gemv", self.fp8_small_m_gemv, 0, 64, limit="0 (off) or the most rows, at most 64", **_F)
        check_str("tokenizer", self.tokenizer, empty=True, what="an HF tokenizer directory or 'tiny'", **_F)
        eos = self.eos_token_ids
        check(isinstance(eos, (list, tuple)) and all(is_int(t) and t >= 0 for t in eos), "eos_token_ids",
              "a list of token ids (integers >= 0)", eos, **_F)
        self.eos_token_ids = tuple(eos)


@dataclass(slots=True)
class CacheConfig:
    # 128: FA4 loads whole 128-key pages with TMA (other page sizes gather rows); on the H200 the reuse trace's
    # attention took 3.28 s at 128 vs 3.56 s at 256 (bench/RESULTS.md, issue 11)
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per KV cache block (a multiple of 16)
    num_kvcache_blocks: int = -1  # -1: size from gpu_memory_utilization (GPU) or cpu_kvcache_gib (CPU)
    gpu_memory_utilization: float = 0.9  # of the GPU's memory, weights and activations included
    cpu_kvcache_gib: float = 1.0  # the KV cache of a CPU engine
    enable_prefix_caching: bool = True  # full blocks are shared by prompts with the same prefix
    # on since issue 38: the lru_pressure scenario (H200, 2026-11-30) evicted 24% fewer cached blocks, hit rate +3.0 pp
    # (CPU: -21%, +5.4 pp); counts that depend on the schedule alone (bench/RESULTS.md, "Scheduler features")
    enable_lru: bool = True  # free cached blocks form an LRU; uncached ones are reused first
    # blocks become prefix-cache hits when the step that computes them is scheduled, so a request admitted in
    # the same step shares them instead of computing them again (off: only after that step ran)
    enable_same_step_prefix_sharing: bool = True  # blocks are hits from the step that computes them
    # "fp8": K/V stored as e4m3 (twice the tokens in the same memory), static scale 1.0 (values clamped to
    # +-448), read by our Triton kernel and the torch path (FA4 takes no FP8 K/V: "auto" picks triton). "auto": the
    # model dtype
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | fp8

    # the block manager records the block hashes it publishes and evicts (chained from the model revision's seed,
    # the routing key's chain), for the router's per-shard holdings (flame_llm/protocol/kv_events.py)
    enable_kv_events: bool = False  # record published/evicted block hashes for the router

    def __post_init__(self) -> None:
        check(is_int(self.block_size) and self.block_size >= 16 and self.block_size % 16 == 0, "block_size",
              "a positive multiple of 16", self.block_size, **_F)
        n = self.num_kvcache_blocks
        check(is_int(n) and (n == -1 or n >= 1), "num_kvcache_blocks", "-1 (sized from memory) or an integer >= 1", n,
              **_F)
        check_number("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True, **_F)
        check_number("cpu_kvcache_gib", self.cpu_kvcache_gib, 0, low_open=True, **_F)
        for name in ("enable_prefix_caching", "enable_lru", "enable_same_step_prefix_sharing", "enable_kv_events"):
            check_bool(name, getattr(self, name), **_F)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES, **_F)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192  # tokens of one step
    max_num_seqs: int = 64  # sequences running at once
    # each feature off reproduces the original two-phase scheduler exactly (SCHEDULER_FEATURES_OFF)
    # on since issue 38: every published burst and load figure ran with it (8,192-token steps under a 32K
    # max_model_len); the starvation scenario (H200): victims' TPOT p99 6,277 -> 35 ms, wall 8.2 -> 2.7 s
    enable_chunked_prefill: bool = True  # a long prompt's prefill spreads over steps
    # chunked prefill: a step that carries decode rows takes at most this many prefill tokens (a step with no
    # decode rows still fills max_num_batched_tokens), so a cold 8K prompt stalls the running streams for a few
    # short steps, not one long one (on the H100 an 8,192-token step takes ~200 ms: the ITL p99 of both flame and
    # vLLM at 12 req/s, issue 39; Sarathi-Serve's token budget). 0: off (the whole token budget, as before)
    max_prefill_tokens_with_decode: int = 0  # chunked prefill: prefill tokens in a step with decode rows (0: off)
    # on since issue 38: the cache_aware scenario (H200): hit rate 0 -> 35.7%, evictions -40%, wall -34%, TTFT p99
    # -34%, TPOT p99 70.5 -> 50.6 ms; a request is passed over at most cache_aware_max_skips times
    enable_cache_aware_schedule: bool = True  # waiting requests with longer cached prefixes go first
    cache_aware_window: int = 64  # waiting requests reordered by cached-prefix length
    cache_aware_max_skips: int = 16  # aging: a request passed over this many times goes first
    # a waiting request whose next uncached block a running sequence is computing waits for it. Off: its one
    # measurement (CPU counts, prefix scenario: 40% fewer prefill tokens) ran with same-step sharing off, which is
    # on by default and removes most of those duplicates; no GPU figure for the under-filled step it costs
    enable_prefix_dedup: bool = False  # wait for a running sequence computing our next block
    # launch step N+1 before reading step N's tokens, so the host prepares a step while the GPU runs the last
    # one. None: on with CUDA (off on CPU, where nothing overlaps, and with speculative decoding)
    async_scheduling: bool | None = None  # prepare step N+1 while N runs (null: on with CUDA)
    # AsyncEngine: after a step hands tokens or results to callers' asyncio loops, its thread waits (without the
    # GIL) until each of those loops has run them, at most this long; on CPU the engine thread otherwise keeps
    # the GIL and the loop that carries a token onwards waits for it. 0: off (no wait)
    handoff_wait_ms: float = 0.0  # AsyncEngine: wait up to this long for callers' loops to take a step's tokens
    # AsyncEngine: the process's GIL switch interval (sys.setswitchinterval). The engine thread returns from each
    # step's sync wanting the GIL while the callers' loop may hold it; Python makes it wait up to the interval
    # (5 ms) before it asks for the GIL back. 0: Python's default left alone
    gil_switch_interval_ms: float = 0.0  # AsyncEngine: GIL switch interval of the engine's process (0: default)
    # asynchronous scheduling reads a step's tokens once the next step is enqueued; an eager step of 8K tokens takes
    # the host ~40 ms to enqueue on the H200 (a decode step runs ~5), so the tokens before it wait that long. With
    # this many tokens or more, an eager step after a shorter one is enqueued only once that one is read and its
    # tokens are handed to callers (the GPU waits that hand-off, ~1 ms). 0: off. Serving (AsyncEngine) only.
    # On by default since the H200's hot-prefix load at 8 req/s: ITL p99 24.6 -> 13.6 ms (vLLM 27.8), all else equal
    emit_before_long_launch: int = 2048  # eager steps of >= this many tokens launch after the last step's tokens go out
    # the step loop (LLMEngine and its model) runs in a child process of its own (engine/engine_process.py), as
    # vLLM's EngineCore does, instead of on a thread beside the callers' asyncio loop: in one process the engine
    # thread waits for the GIL whenever that loop is busy writing streams (issue 39: on the H200 a step every 12.3 ms
    # where vLLM's came every 10.3). Off: AsyncEngine's thread, as before. Not with enable_kv_events; handoff_wait_ms
    # has no effect with it (no engine thread shares the callers' GIL)
    engine_process: bool = False  # run the step loop in a child process (spawned), not a thread

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1, **_F)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, self.max_num_seqs,
                  limit=f"an integer >= max_num_seqs ({self.max_num_seqs})", **_F)
        check_int("max_prefill_tokens_with_decode", self.max_prefill_tokens_with_decode, 0, **_F)
        check_int("cache_aware_window", self.cache_aware_window, 1, **_F)
        check_int("cache_aware_max_skips", self.cache_aware_max_skips, 0, **_F)
        for name in ("enable_chunked_prefill", "enable_cache_aware_schedule", "enable_prefix_dedup"):
            check_bool(name, getattr(self, name), **_F)
        check_bool("async_scheduling", self.async_scheduling, optional=True, **_F)
        check_number("handoff_wait_ms", self.handoff_wait_ms, 0, HANDOFF_WAIT_MAX_MS, **_F)
        check_number("gil_switch_interval_ms", self.gil_switch_interval_ms, 0, 5.0, **_F)
        check_int("emit_before_long_launch", self.emit_before_long_launch, 0, **_F)
        check_bool("engine_process", self.engine_process, **_F)


@dataclass(slots=True)
class RunnerConfig:
    enforce_eager: bool = False  # no CUDA graphs
    fused_ops: bool = True  # Triton RMSNorm(+residual), RoPE and SiLU-mul on CUDA; torch ops elsewhere
    # "auto": on CUDA, flash-attn-4 for steps with prefill tokens when it imports on SM90+ (decode-only steps
    # on our Triton kernel), else ours for every step; torch on CPU. Or "fa4" | "triton" | "flash_attn" | "torch"
    attention_backend: str = "auto"  # auto | fa4 | triton | flash_attn | torch
    # fa4 backend: a mixed step's single-token (decode) rows go to our Triton decode kernel ("triton") or stay
    # in FA4's varlen call with the prefill rows ("fa4")
    mixed_decode_attention: str = "triton"  # fa4 backend: a mixed step's decode rows on triton | fa4
    # steps that carry prefill tokens and hold at most this many tokens replay CUDA graphs too (padded to a
    # token bucket; attention on our Triton kernel with a grid fixed at capture); 0: such steps run eagerly,
    # ~16 ms of launches for a 32-layer model on the H200 (engine/mixed_graphs.py). None: MIXED_GRAPH_TOKENS
    # where decode steps replay graphs (CUDA, not enforce_eager), else 0. No effect on the torch backend
    cuda_graph_mixed_tokens: int | None = None  # steps with prefill up to this many tokens replay CUDA graphs
    # eager steps run the last decoder layer past its K/V store (attention queries, o_proj, MLP, final norm) on
    # the rows whose logits are sampled only: same outputs, ~1/num_layers fewer prefill FLOPs (issue 19; on the
    # H200 +2.7% req/s on 8K-token prompts, tokens identical: bench/RESULTS.md, bench.prune_ab)
    prune_last_layer: bool = True  # last layer after its KV store on sampled rows only (eager steps)
    # decode steps on our Triton kernel split each row's keys until the (row, kv head, split) programs reach this
    # many times the SM count (a graph's grid is its bucket's: 19 rows replay bucket 32, whose 256 programs got no
    # split, 152 of them 8K keys long on 132 SMs; bench.engine.decode_splits). 0: split only while the programs are
    # fewer than the SMs (the rule before). 4 since session 20: the H200's best or near-best split at 8-64 rows, and
    # under load on an H100 (12 req/s, answers 32-512) decode-graph GPU time 13.48 -> 11.99 ms a step
    decode_split_waves: int = 4  # decode split-KV target, in multiples of the SM count (0: the rule before)

    def __post_init__(self) -> None:
        check_bool("enforce_eager", self.enforce_eager, **_F)
        check_bool("fused_ops", self.fused_ops, **_F)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS, **_F)
        check_choice("mixed_decode_attention", self.mixed_decode_attention, MIXED_DECODE_ATTENTION, **_F)
        check_int("cuda_graph_mixed_tokens", self.cuda_graph_mixed_tokens, 0, optional=True, **_F)
        check_bool("prune_last_layer", self.prune_last_layer, **_F)
        check_int("decode_split_waves", self.decode_split_waves, 0, 64, **_F)


@dataclass(slots=True)
class SpeculativeConfig:
    speculative_model: str | None = None  # the draft model's directory
    num_speculative_tokens: int = 0  # draft tokens per step (0 with no speculative_model: off)
    speculative_max_batch_size: int = 8  # speculation turns itself off above this running batch

    def __post_init__(self) -> None:
        check_str("speculative_model", self.speculative_model, optional=True, what="a model directory", **_F)
        check_int("num_speculative_tokens", self.num_speculative_tokens, 0, **_F)
        check_int("speculative_max_batch_size", self.speculative_max_batch_size, 0,
                  limit="an integer >= 0 (0: never speculate)", **_F)

    @property
    def enabled(self) -> bool:
        return self.speculative_model is not None or self.num_speculative_tokens != 0


# the scheduler/cache features whose defaults are on, all off: the original two-phase scheduler (the one-flag A/Bs'
# baseline; the recorded schedules in tests/test_scheduler_features.py)
SCHEDULER_FEATURES_OFF = {"enable_chunked_prefill": False, "enable_lru": False, "enable_cache_aware_schedule": False,
                          "enable_prefix_dedup": False}

GROUPS = {"model_config": ModelConfig, "cache_config": CacheConfig, "scheduler_config": SchedulerConfig,
          "runner_config": RunnerConfig, "speculative_config": SpeculativeConfig}
# every field name is unique across the groups: the flat keyword API (LLM(model, max_num_seqs=...), the
# service YAML's engine section, --engine-json) names fields without their group
_GROUP_OF = {f.name: g for g, cls in GROUPS.items() for f in fields(cls)}
FIELD_NAMES = tuple(name for name in _GROUP_OF if name != "hf_config")


@dataclass(slots=True)
class EngineConfig:
    """The engine's fields in vLLM's groups, before a model is loaded (model_config.model is not used): the
    service YAML's `engine` section, --engine-json and LLM(model, **fields) parse flat field names into it once,
    every field checked with an error naming it. `config(model)` makes the engine's Config."""
    model_config: ModelConfig = field(default_factory=lambda: ModelConfig(""))
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner_config: RunnerConfig = field(default_factory=RunnerConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        _check_across_groups(self)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """From flat field names (any group but the model); ValueError names an unknown one."""
        return _build(cls, "", kwargs)

    def to_kwargs(self, changed_only: bool = False) -> dict:
        """The flat fields but the model and hf_config (changed_only: those that differ from the defaults):
        from_kwargs(**to_kwargs()) rebuilds it."""
        out = {}
        for g in GROUPS:
            group = getattr(self, g)
            out.update({f.name: getattr(group, f.name) for f in fields(group) if f.name not in ("model", "hf_config")})
        if changed_only:
            default = _default_fields()
            out = {k: v for k, v in out.items() if v != default[k]}
        return out

    def config(self, model: str) -> Config:
        """The engine's Config for `model` (a directory with config.json): read, checked, capped."""
        return Config.from_kwargs(model, **self.to_kwargs())

    @property
    def speculative(self) -> bool:
        return self.speculative_config.enabled


@dataclass(slots=True)
class Config(EngineConfig):
    """An EngineConfig for one model: model_config.model is its directory, hf_config is read from it, max_model_len
    is capped at the model's positions. Build it with `Config.from_kwargs(model, **fields)`."""

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> Config:
        """A config from flat field names (any group); ValueError names an unknown one."""
        return _build(cls, model, kwargs)

    def to_kwargs(self) -> dict:
        """The flat fields (model included, hf_config left out): from_kwargs(**to_kwargs()) rebuilds it."""
        return {"model": self.model_config.model, **EngineConfig.to_kwargs(self)}

    def __post_init__(self) -> None:
        m, s = self.model_config, self.scheduler_config
        m.hf_config = load_hf_config(m.model)
        _check_across_groups(self)
        max_pos = getattr(m.hf_config, "max_position_embeddings", m.max_model_len)
        m.max_model_len = min(m.max_model_len, max_pos)
        if not s.enable_chunked_prefill:
            check(s.max_num_batched_tokens >= m.max_model_len, "max_num_batched_tokens",
                  f">= max_model_len ({m.max_model_len}) unless enable_chunked_prefill", s.max_num_batched_tokens, **_F)
        eos = getattr(m.hf_config, "eos_token_id", None)
        if not m.eos_token_ids:
            m.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if not m.model_revision:
            m.model_revision = default_model_revision(m.model)


def _check_across_groups(cfg: EngineConfig) -> None:
    """The rules between groups that need no model (each group checks its own fields)."""
    check(not (cfg.scheduler_config.async_scheduling and cfg.speculative), "async_scheduling",
          "off (None or False) with speculative decoding", cfg.scheduler_config.async_scheduling, **_F)
    # the router's cache events are read from the block manager in the caller's process (KvEventLog)
    check(not (cfg.scheduler_config.engine_process and cfg.cache_config.enable_kv_events), "engine_process",
          "off with enable_kv_events (cache events are read from the block manager in the caller's process)",
          cfg.scheduler_config.engine_process, **_F)


def _build(cls: type[EngineConfig], model: str, kwargs: dict) -> EngineConfig:
    unknown = sorted(map(str, (k for k in kwargs if k not in FIELD_NAMES or k == "model")))
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}; known: {', '.join(sorted(FIELD_NAMES))}")
    parts: dict[str, dict] = {g: {} for g in GROUPS}
    for k, v in kwargs.items():
        parts[_GROUP_OF[k]][k] = v
    groups = {g: GROUPS[g](**parts[g]) for g in GROUPS if g != "model_config"}
    return cls(ModelConfig(model, **parts["model_config"]), **groups)


_DEFAULTS: dict = {}


def _default_fields() -> dict:
    if not _DEFAULTS:
        _DEFAULTS.update(EngineConfig().to_kwargs())
    return _DEFAULTS


def engine_config_from_json(text: str, flag: str = "--engine-json") -> EngineConfig:
    """The one --engine-json parser: a JSON object of flat engine field names into an EngineConfig; ValueError
    names the flag and the field (for an unknown field, the known ones)."""
    return _from_json(text, flag)[0]


def engine_fields_from_json(text: str, flag: str = "--engine-json") -> dict:
    """The fields --engine-json names, checked as engine_config_from_json checks them, as flat keywords to merge
    over other fields (LLM(model, **fields), ServiceConfig's engine)."""
    cfg, named = _from_json(text, flag)
    return {k: v for k, v in cfg.to_kwargs().items() if k in named}


def _from_json(text: str, flag: str) -> tuple[EngineConfig, dict]:
    fields_ = json_object(text, flag)
    try:
        return EngineConfig.from_kwargs(**fields_), fields_
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
