"""The bench's system labels, what each one sets, and the run's setup every system shares.

- flame: the service (router + one engine actor per device) through the Python client (bursts) or its
  HTTP front door (load mode).
- engine: one `flame_llm.serving.http_server` process per device, driven by the sticky-prefix HTTP client.
- vllm: one `vllm serve` process per device, same client; config "default" or "seed" (eager, Triton attention).
Every system uses the same device list: shard k <-> device k (GPU UUID, or cpu-k without GPUs). A label ending in "-rr"
places requests round-robin instead of by prefix (the affinity A/B); "flame-nomix" and "engine-nomix" run steps with
prefill tokens eagerly (cuda_graph_mixed_tokens 0: the A/B of the mixed-step graphs), "flame-mix2k" and "engine-mix2k"
replay them from graphs up to 2,048 tokens (512 by default: the A/B of medium steps whose eager launch may outlast their
GPU time); "flame-noprune" and "engine-noprune" run eager steps' last layer on every row (prune_last_layer off: the A/B
of issue 19's pruning, on by default); "flame-noearly" and "engine-noearly" enqueue an eager step of 2,048+ tokens right
behind the step before it, whose tokens then wait for that launch (emit_before_long_launch 0; by default 2,048: the step
before is read and its tokens handed out first; the A/B of the inter-token gap before a long prefill,
bench/engine/launch_cost.py). "flame-gil" and "engine-gil" set the engine process's GIL switch interval to 0.5 ms
(gil_switch_interval_ms; Python's is 5 ms: the A/B of the engine thread waiting for the GIL behind its callers' loop
after each step, issue 39). The labels of retired levers (-split, -ropestore, -shared, -lt) went with them
(bench/KERNELS.md, "Tried and retired"), and so did those of the client's retired switches (flame-batch, -raystream,
-noresume, -noreroute: issue 38). "flame-fp8" and "engine-fp8" run W8A8 FP8 projections (quantization "fp8": e4m3
weights quantized at load, per-token activation scales; issue 40), "flame-fp8kv" and "engine-fp8kv" add e4m3 K/V
(kv_cache_dtype "fp8": our Triton attention for every step, FA4 takes no FP8 K/V), "vllm-fp8" is `vllm serve
--quantization fp8` (the same scheme: dynamic per-token activations; its KV cache stays bf16). "flame-proc" and
"engine-proc" run the engine's step loop in a child process of its own (engine_process: the A/B of the engine thread
sharing the GIL with its callers' loop, issue 39; vLLM's EngineCore runs apart too). "flame-splits" and
"engine-splits" split decode attention until its programs reach 4x the SMs (decode_split_waves: a decode graph's
split count from its bucket left 17-31 rows with one 8K-key program per row and kv head, issue 39); the default
since session 20, so "flame-nosplits" and "engine-nosplits" (decode_split_waves 0: the rule before) are its A/B.
"flame-fp8-unfused" and "engine-fp8-unfused" are fp8 with fp8_fused_quant off (each projection quantizes its own
input; the fused producers are the default since session 23): that flag's A/B. "flame-chunk2k" and "engine-chunk2k"
give a step that carries decode rows at most 2,048 prefill tokens (max_prefill_tokens_with_decode; off by default: the
A/B of a cold 8K prefill stalling every running stream for one ~200 ms step, issue 39).
"""
from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("flame", "flame-nomix", "flame-mix2k", "flame-noprune", "flame-noearly", "engine", "engine-nomix",
         "engine-mix2k", "engine-noprune",
         "engine-noearly", "flame-gil", "engine-gil", "vllm", "vllm-seed",
         "flame-fp8", "engine-fp8", "vllm-fp8", "flame-fp8kv", "engine-fp8kv", "flame-proc", "engine-proc",
         "flame-splits", "engine-splits", "flame-nosplits", "engine-nosplits", "flame-fp8-unfused",
         "engine-fp8-unfused", "flame-chunk2k", "engine-chunk2k")
# engine fields a system label sets over the run's (the label is the A/B's one flag)
LABEL_ENGINE = {"flame-nomix": {"cuda_graph_mixed_tokens": 0}, "engine-nomix": {"cuda_graph_mixed_tokens": 0},
                "flame-mix2k": {"cuda_graph_mixed_tokens": 2048}, "engine-mix2k": {"cuda_graph_mixed_tokens": 2048},
                "flame-noprune": {"prune_last_layer": False}, "engine-noprune": {"prune_last_layer": False},
                "flame-noearly": {"emit_before_long_launch": 0}, "engine-noearly": {"emit_before_long_launch": 0},
                "flame-gil": {"gil_switch_interval_ms": 0.5}, "engine-gil": {"gil_switch_interval_ms": 0.5},
                "flame-fp8": {"quantization": "fp8"}, "engine-fp8": {"quantization": "fp8"},
                "flame-fp8kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
                "engine-fp8kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
                "flame-proc": {"engine_process": True}, "engine-proc": {"engine_process": True},
                "flame-splits": {"decode_split_waves": 4}, "engine-splits": {"decode_split_waves": 4},
                "flame-nosplits": {"decode_split_waves": 0}, "engine-nosplits": {"decode_split_waves": 0},
                "flame-fp8-unfused": {"quantization": "fp8", "fp8_fused_quant": False},
                "engine-fp8-unfused": {"quantization": "fp8", "fp8_fused_quant": False},
                "flame-chunk2k": {"max_prefill_tokens_with_decode": 2048},
                "engine-chunk2k": {"max_prefill_tokens_with_decode": 2048}}
# client fields (ClientConfig) a flame label sets: its Python client's and its front door's (none now: issue 38
# retired the client switches the labels selected)
LABEL_CLIENT: dict[str, dict] = {}
VLLM_SEED_FLAGS = ("--enforce-eager", "--attention-backend", "TRITON_ATTN")
# `vllm serve` flags of each vllm config (SystemConfig.vllm_config)
VLLM_CONFIG_FLAGS = {"default": (), "seed": VLLM_SEED_FLAGS, "fp8": ("--quantization", "fp8")}


@dataclass(slots=True)
class SystemConfig:
    label: str  # e.g. "flame", "engine-rr", "vllm-seed"
    kind: str  # flame | engine | vllm
    vllm_config: str | None  # "default" | "seed" | "fp8" for vllm (VLLM_CONFIG_FLAGS)
    policy: str  # the router policy placing requests
    engine: dict = field(default_factory=dict)  # engine fields over the run's (LABEL_ENGINE)
    client: dict = field(default_factory=dict)  # flame: ClientConfig fields over the defaults (LABEL_CLIENT)


def parse_system(label: str, sticky_policy: str = "cumulative") -> SystemConfig:
    base, rr = (label[:-3], True) if label.endswith("-rr") else (label, False)
    if base not in KINDS:
        raise ValueError(f"system must be one of {', '.join(KINDS)}, optionally with '-rr' (round-robin "
                         f"placement); got {label!r}")
    kind = "vllm" if base.startswith("vllm") else "flame" if base.startswith("flame") else "engine"
    cfg = ({"vllm-seed": "seed", "vllm-fp8": "fp8"}.get(base, "default")) if kind == "vllm" else None
    return SystemConfig(label, kind, cfg, "round_robin" if rr else sticky_policy, dict(LABEL_ENGINE.get(base, {})),
                        dict(LABEL_CLIENT.get(base, {})))


@dataclass(slots=True)
class Setup:
    model: str  # absolute model dir
    model_revision: str
    devices: list[str]  # shard k's GPU UUID, or cpu-k
    engine: dict  # flame_llm Config fields shared by flame and engine (load_format excluded)
    load_format: str = "dummy"
    log_dir: str = "."
    ray_address: str | None = None
    torch_threads: int = 1  # CPU shards / CPU servers
    cpu_per_shard: float = 0.5
    startup_timeout_s: float = 900.0
    burst_timeout_s: float = 3600.0
    spill_factor: float = 1.25
    vllm_bin: str = "vllm"
    vllm_pythonpath: str = ""
    vllm_args: list[str] = field(default_factory=list)  # extra flags for every vllm serve
    gpu_memory_utilization: float = 0.9
    vllm_return_token_ids: bool = False

    @property
    def on_gpu(self) -> bool:
        return not self.devices[0].startswith("cpu-")
