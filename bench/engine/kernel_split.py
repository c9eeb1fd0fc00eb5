"""Where the GPU time of a seed-trace burst goes: kernel seconds grouped gemm / attention / other, and
GPU idle (wall minus kernel time), for our engine and, when vLLM imports, for vLLM in the same call.

    python -m bench.engine.kernel_split --systems vllm,engine --vllm-pythonpath /tmp/vsite/site --out split.json
    python -m bench.engine.kernel_split --systems engine --engine-json '{"attention_backend": "triton"}' --label triton

Each system runs offline (our LLM.generate; vLLM's LLM.generate with its engine core in-process so the
profiler sees its kernels) in its own process, on the seed's limits and dummy weights: the warmup rounds
(shifted ids), one plain measured burst (its req/s is the offline figure serve-http is held to), then a
further unseen round under torch.profiler (CUDA activity only) for the split. Two systems run in A-B-B-A
order (--order abba, the default), so clock and heat drift falls on both; the report gives b / a in each
order and over both. vLLM's process gets its own PYTHONPATH (--vllm-pythonpath: the bundle's site and this
checkout, nothing else), so the vLLM bundle's package versions never meet ours. Every run also reports its
trace's FLOPs, the roofline time at --peak-tflops (and at the measured matmul ceiling, --measure-ceiling)
and the fraction of it reached (bench/engine/split_report.py)."""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

from bench import REPO
from bench.burst.traces import SEED_LIMITS, TRACE_NAMES, TraceConfig, make_trace, warmup_traces
from bench.engine.split_report import (
    H200_BF16_TFLOPS,
    ModelShape,
    abba,
    render_groups,
    render_kernels,
    render_orders,
    render_roofline,
    roofline,
    trace_flops,
)
from flame_llm.config import engine_fields_from_json

GEMM_WORDS = ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "gemv", "matmul", "splitk", "cublas")
ATTENTION_WORDS = ("attention", "attn", "flash", "fmha", "combine_splits", "shared_decode")


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
    kernels = [(k[:100], round(v / 1e6, 5), counts[k], group(k)) for k, v in sums.most_common()]
    return sum(sums.values()) / 1e6, dict(groups), kernels


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


def run_one(system: str, model: str, traces: list[str], warmup_rounds: int, engine_json: dict,
            peaks: list[float]) -> dict:
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
        kernel_s, groups, kernels = split_of(prof)
        flops = trace_flops(ModelShape.from_config(model), [r.token_ids for r in rounds[warmup_rounds].requests],
                            trace_cfg.output_tokens)
        row = {"requests": len(prompts), "req_per_s": len(prompts) / plain, "wall_plain_s": plain,
               "wall_profiled_s": wall, "kernel_s": kernel_s, "idle_s": wall - kernel_s,
               **{f"{g}_s": groups.get(g, 0.0) for g in ("gemm", "attention", "other")}, "flops": flops,
               "roofline": roofline(flops, wall, len(prompts), peaks[0]),
               "roofline_plain": roofline(flops, plain, len(prompts), peaks[0]), "kernels": kernels}
        if len(peaks) > 1:
            row["roofline_measured"] = roofline(flops, wall, len(prompts), peaks[1])
        if system == "engine":
            row["engine_stats"] = {k: v for k, v in keep.engine.stats().items()
                                   if k in ("attention_jit_compiles", "num_prefill_steps", "num_decode_steps")}
        out["traces"][name] = row
        print(system, name, json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                        for k, v in row.items() if not isinstance(v, (list, dict))}), flush=True)
    return out


CEILING_CODE = """
import json, torch
n = 8192
a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(3):
    a @ b
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []
for _ in range(10):
    s.record(); a @ b; e.record(); e.synchronize(); times.append(s.elapsed_time(e) / 1e3)
print(json.dumps({"matmul_tflops": 2 * n ** 3 / sorted(times)[len(times) // 2] / 1e12}))
"""


def measure_ceiling() -> float | None:
    """bf16 8192^3 matmul TFLOP/s (median of 10, random data) in a child process, or None without a GPU."""
    r = subprocess.run([sys.executable, "-c", CEILING_CODE], capture_output=True, text=True)
    if r.returncode:
        print("matmul ceiling not measured:", r.stderr.strip().splitlines()[-1:], flush=True)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["matmul_tflops"]


def system_env(system: str, vllm_pythonpath: str) -> dict:
    """The environment of a system's process: vLLM's gets this checkout plus the bundle's site only."""
    env = dict(os.environ)
    if system == "vllm" and vllm_pythonpath:
        here = REPO
        env["PYTHONPATH"] = os.pathsep.join([here, *vllm_pythonpath.split(os.pathsep)])
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def report(results: list[dict], systems: list[str]) -> str:
    parts = [render_groups(results)]
    if len(systems) == 2:
        parts.append(render_orders(results, systems[0], systems[1]))
    parts += [render_roofline(results), render_kernels(results)]
    return "\n\n".join(p for p in parts if p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine.kernel_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="engine,vllm", help="comma-separated: engine, vllm (vllm is skipped, "
                   "with a note, when it does not import)")
    p.add_argument("--traces", default=",".join(TRACE_NAMES))
    p.add_argument("--model", default="configs/models/llama-3.1-8b")
    p.add_argument("--warmup-rounds", type=int, default=2)
    p.add_argument("--engine-json", default="{}", help="more flame_llm Config fields for our engine")
    p.add_argument("--label", default="", help="a name for this configuration in the table")
    p.add_argument("--order", choices=("abba", "once"), default="abba",
                   help="abba: two systems run A B B A (each first once); once: each system once, as listed")
    p.add_argument("--vllm-pythonpath", default="", help="PYTHONPATH of the vLLM process (its bundle's site); "
                   "this checkout is put first; empty: inherit ours")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS, help="roofline peak, bf16 TFLOP/s")
    p.add_argument("--measure-ceiling", action="store_true", help="also measure the matmul ceiling first and "
                   "report the fraction of the roofline at it")
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one system in this process
    p.add_argument("--peaks", default="", help=argparse.SUPPRESS)  # internal: the peaks the parent chose
    a = p.parse_args(argv)
    traces = [t for t in a.traces.split(",") if t]
    engine_json = engine_fields_from_json(a.engine_json)
    if a.one:
        peaks = [float(x) for x in a.peaks.split(",") if x] or [a.peak_tflops]
        res = run_one(a.one, a.model, traces, a.warmup_rounds, engine_json, peaks)
        res["label"] = a.label
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        return 0
    systems = [s for s in a.systems.split(",") if s]
    unknown = sorted(set(systems) - {"engine", "vllm"})
    if unknown:
        raise SystemExit(f"--systems: unknown system(s) {unknown}; known: engine, vllm")
    ceiling = measure_ceiling() if a.measure_ceiling else None
    peaks = [a.peak_tflops] + ([ceiling] if ceiling else [])
    if "vllm" in systems:
        probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True,
                               env=system_env("vllm", a.vllm_pythonpath))
        if probe.returncode:
            print("vllm does not import here: its split is not measured:",
                  (probe.stderr.strip().splitlines() or ["?"])[-1], flush=True)
            systems.remove("vllm")
    order = abba(systems) if a.order == "abba" else systems
    results = []
    for run, system in enumerate(order):
        label = a.label if (a.label and system == "engine") else system
        part = f"{a.out}.{run}-{system}.json"
        cmd = [sys.executable, "-m", "bench.engine.kernel_split", "--one", system, "--model", a.model, "--traces",
               a.traces, "--warmup-rounds", str(a.warmup_rounds), "--engine-json", a.engine_json,
               "--label", label, "--peaks", ",".join(str(x) for x in peaks), "--out", part]
        print(f"run {run + 1}/{len(order)}: {system}", flush=True)
        if subprocess.run(cmd, env=system_env(system, a.vllm_pythonpath)).returncode == 0:
            res = json.load(open(part))
            res["run"] = run
            results.append(res)
        else:
            print(f"{system}: the profiled run failed (see its output above)", flush=True)
    with open(a.out, "w") as f:
        json.dump({"argv": sys.argv, "order": order, "matmul_tflops": ceiling, "results": results}, f, indent=1)
    if results:
        print(report(results, [r.get("label") or r["system"] for r in results[:2]]))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
