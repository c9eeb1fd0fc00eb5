"""Scheduler-feature scenarios (issue 4): each variant in its own process, a table against the seed.

    python -m bench.load.scenarios --scenario all --out bench/results/scenarios.json          # H200, ~5 min
    python -m bench.load.scenarios --scenario all --device cpu --scale small --out /tmp/s.json  # tiny model

Full scale: Qwen3-0.6B config with dummy weights, CUDA graphs on (the default), KV capacity set by
an explicit block count. Small scale: the tiny test model (created on first use) on CPU. Every
variant runs a shifted warmup (same lengths and prefix relations, other token ids) over its first
requests (spread over the burst), then drops the prefix cache and zeroes the counters, then measures one finite burst.
Besides wall-clock figures each run reports step counts (a request's TPOT in steps, for example),
which depend on the schedule only and so compare exactly across machines.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

from bench import MODELS
from bench.load.scenario_workloads import SCALES, SCENARIOS, Request, build_requests, find_variant, scenario, shifted

QWEN3_06B = os.path.join(MODELS, "qwen3-0.6b")
WARMUP_REQUESTS = 16

# the seed's reported effects: metric -> (how it is compared, the seed's figure, its text)
SEED = {
    "starvation": {"victim_tpot_p99_ms": ("pct", -86.0, "822.9 → 117.6 ms (−86%)")},
    "prefix": {"prefix_hit_rate": ("level", 88.3, "88.3%"), "ttft_p50_ms": ("pct", -58.0, "−58%"),
               "wall_s": ("pct", -60.0, "−60%")},
    "lru_pressure": {"evictions": ("pct", -24.0, "−24%"), "prefix_hit_rate": ("pp", 2.1, "+2.1 pp")},
    "cache_aware": {"prefix_hit_rate": ("level", 72.9, "0 → 72.9%"), "evictions": ("pct", -76.0, "−76%"),
                    "wall_s": ("pct", -31.0, "−31%")},
}
# columns of each scenario's table
COLUMNS = {
    "starvation": ["victim_tpot_p50_ms", "victim_tpot_p99_ms", "victim_tpot_p99_steps", "victim_ttft_p50_ms",
                   "wall_s", "prefill_steps", "mixed_steps", "decode_steps"],
    "prefix": ["prefix_hit_rate", "prefill_tokens", "deferred_admissions", "ttft_p50_ms", "ttft_p99_ms", "wall_s",
               "prefill_tokens_per_s", "prefill_steps"],
    "lru_pressure": ["prefix_hit_rate", "evictions", "saved_tokens", "ttft_p50_ms", "wall_s", "preemptions"],
    "cache_aware": ["prefix_hit_rate", "evictions", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "wall_s",
                    "steps"],
}


def drive(engine, requests: list[Request]) -> tuple[list, float, dict, dict]:
    """Submit every request, step until all finish; (seqs, wall seconds, first-token step, finish step)."""
    from flame_llm import SamplingParams

    t0 = time.perf_counter()
    seqs = [engine.add_request(r.prompt, SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True))
            for r in requests]
    first_step: dict[int, int] = {}
    finish_step: dict[int, int] = {}
    no_token_yet = list(seqs)
    step = 0
    while not engine.is_finished():
        finished, _ = engine.step()
        step += 1
        if no_token_yet:
            for s in no_token_yet:
                if s.first_token_time is not None:
                    first_step[s.seq_id] = step
            no_token_yet = [s for s in no_token_yet if s.first_token_time is None]
        for s in finished:
            finish_step[s.seq_id] = step
    return seqs, time.perf_counter() - t0, first_step, finish_step


def group_metrics(name: str, outputs, seqs, first_step: dict, finish_step: dict) -> dict:
    from bench.metrics import latency_ms, percentile, request_latencies

    ttft, tpot = request_latencies(outputs)
    tpot_steps = [(finish_step[s.seq_id] - first_step[s.seq_id]) / (s.num_completion_tokens - 1)
                  for s in seqs if s.num_completion_tokens > 1]
    return {**latency_ms(ttft, f"{name}_ttft"), **latency_ms(tpot, f"{name}_tpot"),
            f"{name}_tpot_p50_steps": percentile(tpot_steps, 50), f"{name}_tpot_p99_steps": percentile(tpot_steps, 99)}


def run_variant(job: dict) -> dict:
    """One variant in this process: build the engine, warm up, measure; the result is JSON-able."""
    import torch

    from bench.metrics import summarize
    from flame_llm import Config, LLMEngine

    if job["device"] == "cpu":
        torch.set_num_threads(1)  # tiny ops: extra threads only add barrier waits on a shared CPU
    sc = scenario(job["scenario"], job["scale"])
    variant = find_variant(sc, job["variant"])
    cfg = {**sc.engine, **variant.engine}
    engine = LLMEngine(Config.from_kwargs(job["model"], load_format="dummy", device=job["device"], **cfg))
    vocab = engine.vocab_size
    requests = build_requests(sc, variant, vocab, job["seed"])
    sample = requests[:: max(1, len(requests) // WARMUP_REQUESTS)][:WARMUP_REQUESTS]  # every kind of request
    for shift in (7919, 15838):  # two rounds; the second exercises prefix hits on the warmup ids
        drive(engine, shifted(sample, shift, vocab))
    engine.block_manager.reset_prefix_cache()
    engine.scheduler.reset_stats()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seqs, wall, first_step, finish_step = drive(engine, requests)
    outputs = [engine.make_output(s) for s in seqs]
    stats = engine.stats()
    result = summarize(outputs, stats, wall)
    result["steps"] = max(finish_step.values())
    for group in sorted({r.group for r in requests} - {""}):
        idx = [i for i, r in enumerate(requests) if r.group == group]
        result.update(group_metrics(group, [outputs[i] for i in idx], [seqs[i] for i in idx], first_step,
                                    finish_step))
    result["config"] = cfg
    result["attention_backend"], result["cuda_graphs"] = stats["attention_backend"], stats["cuda_graphs"]
    return result


def run_isolated(job: dict) -> dict:
    """run_variant in a fresh spawned process, so each variant starts with all memory released."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_variant, (job,))


def change(kind: str, base: float | None, value: float | None) -> float | None:
    """pct: relative change in %; pp: difference of two rates in points; level: the rate itself in %."""
    if value is None:
        return None
    if kind == "level":
        return value * 100
    if base is None:
        return None
    if kind == "pp":
        return (value - base) * 100
    return (value / base - 1) * 100 if base else None


def compare(name: str, variants: dict[str, dict]) -> list[dict]:
    """Each non-baseline variant against the first one, on the metrics the seed reported."""
    base_name, *others = list(variants)
    rows = []
    for other in others:
        for metric, (kind, seed_value, seed_text) in SEED[name].items():
            ours = change(kind, variants[base_name].get(metric), variants[other].get(metric))
            meets = None if ours is None else (ours <= seed_value if kind == "pct" else ours >= seed_value)
            rows.append(dict(variant=other, baseline=base_name, metric=metric, kind=kind, ours=ours,
                             seed=seed_value, seed_text=seed_text, meets_seed=meets))
    return rows


def fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1 else f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def markdown(name: str, variants: dict[str, dict], rows: list[dict]) -> str:
    cols = COLUMNS[name]
    lines = [f"#### {name}", "", "| variant | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {v} | " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for v, r in variants.items()]
    lines += ["", "| change | ours | seed | at least as good |", "|---|---|---|---|"]
    for r in rows:
        unit = {"pct": "%", "pp": " pp", "level": "%"}[r["kind"]]
        ours = "—" if r["ours"] is None else f"{r['ours']:+.1f}{unit}" if r["kind"] != "level" else f"{r['ours']:.1f}%"
        label = f"{r['metric']}: {r['baseline']} → {r['variant']}"
        lines.append(f"| {label} | {ours} | {r['seed_text']} | {fmt(r['meets_seed'])} |")
    return "\n".join(lines) + "\n"


def run(names: list[str], scale: str, device: str, model: str, seed: int = 0, isolate: bool = True) -> dict:
    report = {"scale": scale, "device": device, "model": os.path.abspath(model), "seed": seed,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "scenarios": {}}
    for name in names:
        sc = scenario(name, scale)
        variants = {}
        for v in sc.variants:
            job = dict(scenario=name, variant=v.name, scale=scale, device=device, model=model, seed=seed)
            t = time.perf_counter()
            variants[v.name] = run_isolated(job) if isolate else run_variant(job)
            print(f"{name}/{v.name}: {time.perf_counter() - t:.1f} s", flush=True)
        report["scenarios"][name] = {"engine": sc.engine, "params": sc.params, "variants": variants,
                                     "changes": compare(name, variants), "markdown": None}
        report["scenarios"][name]["markdown"] = markdown(name, variants, report["scenarios"][name]["changes"])
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="all", choices=("all",) + SCENARIOS)
    ap.add_argument("--scale", default="full", choices=SCALES)
    ap.add_argument("--device", default="cuda", help="cuda | cpu")
    ap.add_argument("--model", default=None, help="model directory (default: Qwen3-0.6B config; small: tiny model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--in-process", action="store_true", help="run variants in this process (tests)")
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        if args.scale == "small":
            from flame_llm.models.tiny import ensure_tiny_default
            model = ensure_tiny_default()
        else:
            model = QWEN3_06B
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    report = run(names, args.scale, args.device, model, args.seed, isolate=not args.in_process)
    for name in names:
        print(report["scenarios"][name]["markdown"])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
