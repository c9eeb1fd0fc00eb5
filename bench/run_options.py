"""The options of one bench run (RunOptions) and their flags, shared by bench.burst.runner, bench.burst.pairs and
`flame-llm
bench`: defaults that depend on the machine (CPU_DEFAULTS without a GPU: the tiny model), serve's memory preflight
for the shards a run starts, and the help's examples."""
from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass, field

from bench.burst.traces import SEED_LIMITS, TraceConfig

_T = TraceConfig()  # the trace defaults


@dataclass(slots=True)
class RunOptions:
    model: str = "configs/models/llama-3.1-8b"  # a model dir, or "tiny" (CPU_DEFAULTS without a GPU)
    load_format: str = "dummy"
    out: str = "out/bench"  # relative to the working directory; out/ is in .gitignore
    num_shards: int = 0  # 0: every visible GPU (or 2 CPU shards without GPUs)
    gpu_uuids: list[str] = field(default_factory=list)
    policy: str = "cumulative"  # the seed's sticky placement; a "-rr" system label uses round_robin
    docs: int = _T.num_docs
    questions: int = _T.questions
    doc_tokens: int = _T.doc_tokens
    question_tokens: int = _T.question_tokens
    output_tokens: int = _T.output_tokens
    seed: int = _T.seed
    warmup_rounds: int = 2
    max_model_len: int = SEED_LIMITS["max_model_len"]
    max_num_seqs: int = SEED_LIMITS["max_num_seqs"]
    max_num_batched_tokens: int = SEED_LIMITS["max_num_batched_tokens"]
    enforce_eager: bool = False
    engine_json: dict = field(default_factory=dict)  # more Config fields for flame and engine
    torch_threads: int = 1
    startup_timeout_s: float = 900.0
    burst_timeout_s: float = 3600.0
    vllm_bin: str = "vllm"
    vllm_pythonpath: str = ""
    vllm_args: list[str] = field(default_factory=list)
    vllm_return_token_ids: bool = False
    # the decode trace (issue 39): prompts sharing nothing, prompt and answer lengths drawn uniformly in LO-HI
    decode_prompts: int = 256
    decode_prompt_tokens: str = "1024-2048"
    decode_output_tokens: str = "128-1024"

    def decode_range(self, name: str) -> tuple[int, int]:
        """(lo, hi) of a decode_* "LO-HI" option; ValueError naming the flag and the limit otherwise."""
        spec = getattr(self, name)
        flag = "--" + name.replace("_", "-")
        try:
            lo, hi = (int(x) for x in str(spec).split("-", 1))
        except ValueError:
            raise ValueError(f"{flag} must be LO-HI (token counts); got {spec!r}") from None
        floor = 2 if name == "decode_prompt_tokens" else 1  # a prompt is a document of >= 1 token and a question
        if not floor <= lo <= hi:
            raise ValueError(f"{flag} needs {floor} <= LO <= HI; got {spec!r}")
        return lo, hi


_D = RunOptions()
# Without a GPU on this machine these flags default to a CPU-sized run of the tiny model (`flame-llm bench` once
# hit 14.6 GB of RAM in 33 s loading Llama-3.1-8B shapes on a 2-core laptop); explicit flags win either way.
# The CPU trace is sized so a burst lasts a few seconds on 2 cores (see bench/burst/report.py: MIN_BURST_S).
CPU_DEFAULTS = {"model": "tiny", "load_format": "auto", "docs": 16, "doc_tokens": 1024,
                "question_tokens": 16, "max_model_len": 2048, "max_num_seqs": 32, "max_num_batched_tokens": 2048,
                "decode_prompts": 32, "decode_prompt_tokens": "128-256", "decode_output_tokens": "32-128",
                "engine_json": '{"cpu_kvcache_gib": 0.125}'}  # the CPU trace's KV fits in a few MB
GPU_DEFAULTS = {**{k: getattr(_D, k) for k in CPU_DEFAULTS if k != "engine_json"}, "engine_json": "{}"}
_HELP = {"model": "model dir (config.json; dummy weights) or 'tiny'",
         "load_format": "dummy: random weights from config.json; auto: the safetensors",
         "docs": "documents per trace", "doc_tokens": "tokens per document", "question_tokens": "tokens per question",
         "max_model_len": "engine max_model_len (flame, engine, vllm)", "max_num_seqs": "engine max_num_seqs",
         "max_num_batched_tokens": "engine max_num_batched_tokens (below max_model_len: chunked prefill)",
         "engine_json": "more flame_llm Config fields (flame and engine), a JSON object",
         "decode_prompts": "prompts of the decode trace", "decode_prompt_tokens": "decode trace: prompt lengths LO-HI "
         "(drawn uniformly, seeded)", "decode_output_tokens": "decode trace: answer lengths LO-HI (drawn, EOS ignored)"}


def _profiled(name: str, **kwargs) -> tuple:
    """A flag whose default depends on whether this machine has a GPU (filled in by resolve_options)."""
    gpu, cpu = GPU_DEFAULTS[name], CPU_DEFAULTS[name]
    return (("--" + name.replace("_", "-"),), {"default": argparse.SUPPRESS, **kwargs,
                                               "help": f"{_HELP[name]} (default: {gpu} with a GPU, {cpu} without)"})


# (flags, add_argument kwargs): the options of one run, shared by bench.burst.runner, bench.burst.pairs and `flame-llm
# bench`
RUN_ARGUMENTS = [
    _profiled("model"),
    _profiled("load_format", choices=("dummy", "auto")),
    (("--out",), {"default": _D.out, "help": "results dir: raw/ records, logs/, report files"}),
    (("--num-shards",), {"type": int, "default": 0, "help": "0: every local GPU, or 2 CPU shards"}),
    (("--gpu-uuids",), {"default": "", "help": "comma-separated GPU UUIDs to use (empty: all)"}),
    (("--policy",), {"default": _D.policy, "choices": ("load_guarded", "cumulative"),
                     "help": "sticky placement policy (labels ending in -rr use round_robin)"}),
    *[_profiled(n, type=int) for n in ("docs", "doc_tokens", "question_tokens")],
    (("--questions",), {"type": int, "default": _D.questions, "help": "questions per document (reuse trace)"}),
    (("--output-tokens",), {"type": int, "default": _D.output_tokens, "help": "output tokens per request (EOS "
                            "ignored)"}),
    (("--seed",), {"type": int, "default": _D.seed, "help": "the trace's token ids"}),
    (("--warmup-rounds",), {"type": int, "default": _D.warmup_rounds, "help": "full rounds of the trace, shifted "
                            "in the vocabulary, before the measured burst"}),
    *[_profiled(n, type=int) for n in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")],
    (("--torch-threads",), {"type": int, "default": _D.torch_threads, "help": "CPU intra-op threads per shard"}),
    (("--enforce-eager",), {"action": "store_true", "help": "flame and engine without CUDA graphs"}),
    _profiled("engine_json"),
    _profiled("decode_prompts", type=int), _profiled("decode_prompt_tokens"), _profiled("decode_output_tokens"),
    (("--startup-timeout-s",), {"type": float, "default": _D.startup_timeout_s, "help": "a system's start"}),
    (("--burst-timeout-s",), {"type": float, "default": _D.burst_timeout_s, "help": "one burst, warmup rounds "
                              "each"}),
    (("--vllm-bin",), {"default": _D.vllm_bin, "help": "the vllm executable"}),
    (("--vllm-pythonpath",), {"default": "", "help": "prepended to PYTHONPATH of vllm replicas only"}),
    (("--vllm-args",), {"default": "", "help": "extra flags for every `vllm serve`, one string"}),
    (("--vllm-return-token-ids",), {"action": "store_true", "help": "ask vLLM to echo token ids (prompt echo "
                                    "costs; otherwise: output length from usage)"}),
]
BENCH_EPILOG = """examples:
  # CPU, no GPU here: the tiny model and CPU-sized traces are the defaults (3 pairs: ~5 min on 2 cores)
  flame-llm bench --systems flame,engine --traces reuse --pairs 3
  # GPU: Llama-3.1-8B shapes with dummy weights, one shard per GPU, the seed's traces, against vLLM
  flame-llm bench --systems flame,engine,vllm --traces no-reuse,reuse --pairs 5 --out out/bench-gpu
  # MLPerf LoadGen's Offline and Server scenarios, MLPerf-style (not a submission); CPU: the lengths x 0.1
  flame-llm bench --mode loadgen --systems flame --scenario offline,server --find-qps --mlperf-samples 1000 \
    --mlperf-len-scale 0.1 --mlperf-duration-s 10 --out out/loadgen-cpu"""


def add_run_args(p: argparse.ArgumentParser) -> None:
    for flags, kwargs in RUN_ARGUMENTS:
        p.add_argument(*flags, **kwargs)


def has_gpu() -> bool:
    from actors.pinning import local_gpu_uuids
    return bool(local_gpu_uuids())


def resolve_options(a: argparse.Namespace) -> str:
    """Fill the machine-dependent flags left unset (GPU_DEFAULTS with a GPU here, CPU_DEFAULTS without); returns
    which ("gpu" or "cpu"). Idempotent."""
    if not hasattr(a, "defaults_for"):
        a.defaults_for = "gpu" if has_gpu() else "cpu"
        for k, v in (GPU_DEFAULTS if a.defaults_for == "gpu" else CPU_DEFAULTS).items():
            if not hasattr(a, k):
                setattr(a, k, v)
    return a.defaults_for


def options_from_args(a: argparse.Namespace) -> RunOptions:
    from flame_llm.config import engine_fields_from_json

    resolve_options(a)
    try:
        extra = engine_fields_from_json(a.engine_json)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    names = [f for f in RunOptions.__dataclass_fields__ if f not in ("gpu_uuids", "engine_json", "vllm_args")]
    o = RunOptions(**{n: getattr(a, n) for n in names}, engine_json=extra, vllm_args=shlex.split(a.vllm_args),
                   gpu_uuids=[u.strip() for u in a.gpu_uuids.split(",") if u.strip()])
    try:
        for name in ("decode_prompt_tokens", "decode_output_tokens"):
            o.decode_range(name)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if o.decode_prompts < 1:
        raise SystemExit(f"--decode-prompts must be >= 1; got {o.decode_prompts}")
    return o


def check_bench_memory(a: argparse.Namespace, available: int | None = None) -> None:
    """Serve's memory preflight (flame_llm.serving.preflight.check_cpu_memory) for the shards a bench run starts
    on this machine's CPUs: RuntimeError in one line before anything loads when they do not fit."""
    from flame_llm.serving.preflight import check_cpu_memory
    from flame_llm.serving.service_config import ServiceConfig

    o = options_from_args(a)
    shards = o.num_shards or (1 if has_gpu() else 2)  # with a GPU the check returns at once
    cfg = ServiceConfig.from_kwargs(model=o.model, load_format=o.load_format, engine=engine_config(o),
                                    num_shards=shards, address=os.environ.get("RAY_ADDRESS") or None)
    try:
        check_cpu_memory(cfg, model_dir(o), f"flame-llm bench --model {o.model}", available)
    except RuntimeError as e:
        raise RuntimeError(f"{e}. For bench on CPU leave out --model and the sizes: the CPU defaults (the tiny "
                           "model) apply") from None


def engine_config(o: RunOptions) -> dict:
    """The Config fields flame's actors and the engine servers share, matching vLLM's flags."""
    cfg = {"max_model_len": o.max_model_len, "max_num_seqs": o.max_num_seqs,
           "max_num_batched_tokens": o.max_num_batched_tokens, "enable_prefix_caching": True,
           "enable_chunked_prefill": o.max_num_batched_tokens < o.max_model_len, "enforce_eager": o.enforce_eager}
    return {**cfg, **o.engine_json}


def model_dir(o: RunOptions) -> str:
    from flame_llm.models.tiny import resolve_model
    return os.path.abspath(resolve_model(o.model))


