"""Where the GPU time of a seed-trace burst goes: kernel seconds grouped gemm / attention / other, and
GPU idle (wall minus kernel time), for our engine and, when vLLM imports, for vLLM in the same call.

    python -m bench.kernel_split --systems engine,vllm --out split.json
    python -m bench.kernel_split --systems engine --engine-json '{"attention_backend": "triton"}' --label triton

Each system runs offline (our LLM.generate; vLLM's LLM.generate with its engine core in-process so the
profiler sees its kernels) in its own process, on the seed's limits and dummy weights: the warmup rounds
(shifted ids), one plain measured burst (its req/s is the offline figure serve-http is held to), then a
further unseen round under torch.profiler (CUDA activity only) for the split."""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

from bench.traces import SEED_LIMITS, TRACE_NAMES, TraceConfig, make_trace, warmup_traces
from flame_llm.config import engine_fields_from_json

GEMM_WORDS = ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "gemv", "matmul", "splitk", "cublas")
ATTENTION_WORDS = ("attention", "attn", "flash", "fmha", "combine_splits")


def group(kernel: str) -> str:
    n = kernel.lower()
    if any(w in n for w in ATTENTION_WORDS):
        return "attention"
    if any(w in n for w in GEMM_WORDS):
        return "gemm"
    return "other"


def split_of(prof) -> tuple[float, dict, list]:
    """(kernel seconds, seconds per group, top kernels) of a torch.profiler run."""
    sums, counts = collections.Counter(), collections.Counter()
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us and e.key and not e.key.startswith("ProfilerStep"):
            sums[e.key] += us
            counts[e.key] += e.count
    groups = collections.Counter()
    for k, v in sums.items():
        groups[group(k)] += v / 1e6
    top = [(k[:100], round(v / 1e6, 4), counts[k], group(k)) for k, v in sums.most_common(30)]
    return sum(sums.values()) / 1e6, dict(groups), top


def _make_generate(system: str, model: str, engine_json: dict):
    """(generate(list of token-id lists), info) for one system, loaded once."""
    if system == "engine":
        from flame_llm import LLM, SamplingParams

        llm = LLM(model, load_format="dummy", enable_prefix_caching=True, enable_chunked_prefill=True,
                  **(SEED_LIMITS | engine_json))
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        info = {k: v for k, v in llm.engine.stats().items() if k in ("attention_backend", "cuda_graphs",
                                                                      "async_scheduling")}
        return (lambda prompts: llm.generate(prompts, sp, use_tqdm=False)), info, llm
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
              gpu_memory_utilization=0.9, seed=0, **SEED_LIMITS)
    sp = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0, detokenize=False)
    import vllm
    info = {"vllm": vllm.__version__}
    return (lambda prompts: llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                                         use_tqdm=False)), info, llm


def run_one(system: str, model: str, traces: list[str], warmup_rounds: int, engine_json: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    generate, info, keep = _make_generate(system, model, engine_json)
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    out = {"system": system, "info": info, "engine_json": engine_json, "load_s": time.perf_counter() - t0,
           "traces": {}}
    for name in traces:
        trace_cfg = TraceConfig(name=name, vocab_size=vocab, seed=0)
        rounds = list(warmup_traces(trace_cfg, rounds=warmup_rounds + 1))
        for warm in rounds[:warmup_rounds]:
            generate([r.token_ids.tolist() for r in warm.requests])
        prompts = [r.token_ids.tolist() for r in make_trace(trace_cfg).requests]
        torch.cuda.synchronize()
        t = time.perf_counter()
        generate(prompts)
        torch.cuda.synchronize()
        plain = time.perf_counter() - t
        profiled = [r.token_ids.tolist() for r in rounds[warmup_rounds].requests]  # unseen too
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            generate(profiled)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        kernel_s, groups, top = split_of(prof)
        row = {"requests": len(prompts), "req_per_s": len(prompts) / plain, "wall_plain_s": plain,
               "wall_profiled_s": wall, "kernel_s": kernel_s, "idle_s": wall - kernel_s,
               **{f"{g}_s": groups.get(g, 0.0) for g in ("gemm", "attention", "other")}, "top": top}
        if system == "engine":
            row["engine_stats"] = {k: v for k, v in keep.engine.stats().items()
                                   if k in ("attention_jit_compiles", "num_prefill_steps", "num_decode_steps")}
        out["traces"][name] = row
        print(system, name, json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                        for k, v in row.items() if k != "top"}), flush=True)
    return out


def render(results: list[dict]) -> str:
    cols = [(r.get("label") or r["system"], r, t) for r in results for t in r["traces"]]
    lines = ["| seconds | " + " | ".join(f"{label} {t}" for label, _, t in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for key, name in (("req_per_s", "req/s (plain burst)"), ("wall_profiled_s", "wall (profiled round)"),
                      ("gemm_s", "GEMM"), ("attention_s", "attention"), ("other_s", "other kernels"),
                      ("idle_s", "GPU idle (wall - kernels)")):
        lines.append(f"| {name} | " + " | ".join(f"{r['traces'][t][key]:.3f}" for _, r, t in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernel_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="engine,vllm", help="comma-separated: engine, vllm (vllm is skipped, "
                   "with a note, when it does not import)")
    p.add_argument("--traces", default=",".join(TRACE_NAMES))
    p.add_argument("--model", default="configs/models/llama-3.1-8b")
    p.add_argument("--warmup-rounds", type=int, default=2)
    p.add_argument("--engine-json", default="{}", help="more flame_llm Config fields for our engine")
    p.add_argument("--label", default="", help="a name for this configuration in the table")
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one system in this process
    a = p.parse_args(argv)
    traces = [t for t in a.traces.split(",") if t]
    engine_json = engine_fields_from_json(a.engine_json)
    if a.one:
        res = run_one(a.one, a.model, traces, a.warmup_rounds, engine_json)
        res["label"] = a.label
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        return 0
    results = []
    for system in [s for s in a.systems.split(",") if s]:
        if system == "vllm" and subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode:
            print("vllm does not import here: its split is not measured", flush=True)
            continue
        part = f"{a.out}.{system}.json"
        cmd = [sys.executable, "-m", "bench.kernel_split", "--one", system, "--model", a.model, "--traces",
               a.traces, "--warmup-rounds", str(a.warmup_rounds), "--engine-json", a.engine_json,
               "--label", a.label or system, "--out", part]
        if subprocess.run(cmd).returncode == 0:
            results.append(json.load(open(part)))
        else:
            print(f"{system}: the profiled run failed (see its output above)", flush=True)
    with open(a.out, "w") as f:
        json.dump({"argv": sys.argv, "results": results}, f, indent=1)
    if results:
        print(render(results))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
