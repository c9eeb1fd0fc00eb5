"""What AsyncEngine's bounded hand-off (SchedulerConfig.handoff_wait_ms) costs in throughput: the same bursts
through one AsyncEngine per variant, in one process, variants interleaved round by round (a shared machine's drift
tilts none of them); medians over rounds. Correctness first: every variant's greedy tokens equal the first's.

Variants: `off` (0), `handshake=MS` (the engine thread waits, GIL released, until the loops it handed a step's work
ran it, at most MS), `sleep=MS` (experiment: a blind time.sleep(MS) after each step that handed work instead).
Workloads: `generate` (N concurrent generate() calls: only the steps that finish requests hand work), `stream`
(S concurrent streams: every step hands tokens), `stream1` (one stream: the per-token step rate).
The offline LLM.generate never uses AsyncEngine, so the flag cannot touch it.

    python -m bench.service.handoff_cost --rounds 5 --out cost.json
    python -m bench.service.handoff_cost --model MODEL_DIR --variants off,handshake=0.5 --generate 256 --streams 64 \
        --engine-json '{"gpu_memory_utilization": 0.4}' --out cost-gpu.json     # one GPU, two engines
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import types

import numpy as np

from bench.provenance import write_json


def _sleep_wait(self) -> None:  # the `sleep` design: replaces AsyncEngine._wait_handoff on one instance
    self._handed = set()
    t0 = time.perf_counter()
    time.sleep(self._handoff_s)
    waited = time.perf_counter() - t0
    h = self._handoff
    h["handoff_waits"] += 1
    h["handoff_wait_s"] += waited
    h["handoff_wait_max_s"] = max(h["handoff_wait_max_s"], waited)


def make_engine(model: str, spec: str, base: dict):
    from flame_llm import AsyncEngine

    design, _, ms = spec.partition("=")
    assert design in ("off", "handshake", "sleep"), spec
    eng = AsyncEngine.from_args(model, **base, handoff_wait_ms=float(ms or 0))
    if design == "sleep":
        eng._wait_handoff = types.MethodType(_sleep_wait, eng)
    return eng


async def _stream(eng, prompt, sp) -> list[int]:
    return [t async for t in eng.stream(prompt, sp)]


async def run_workload(eng, prompts: list[list[int]], sp, stream: bool) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    if stream:
        outs = await asyncio.gather(*(_stream(eng, p, sp) for p in prompts))
    else:
        outs = [o.output_token_ids for o in await asyncio.gather(*(eng.generate(p, sp) for p in prompts))]
    return time.perf_counter() - t0, outs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--variants", default="off,handshake=0.5,sleep=0.2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--generate", type=int, default=64, help="concurrent generate() calls")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--engine-json", default="{}", help="engine fields of every variant's engine; on a GPU give each "
                   'its share, e.g. \'{"gpu_memory_utilization": 0.4}\' for two variants')
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch

    from flame_llm import SamplingParams
    from flame_llm.config import load_hf_config
    from flame_llm.models.tiny import resolve_model

    torch.set_num_threads(a.torch_threads)
    model = resolve_model(a.model)
    vocab = load_hf_config(model).vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, a.prompt_tokens).tolist() for _ in range(max(a.generate, a.streams))]
    sp = SamplingParams(temperature=0, max_tokens=a.output_tokens, ignore_eos=True)
    work = {"generate": (prompts[:a.generate], False), "stream": (prompts[:a.streams], True),
            "stream1": (prompts[:1], True)}
    base = {"cpu_kvcache_gib": 0.25, "max_num_seqs": max(a.generate, a.streams), **json.loads(a.engine_json)}
    variants = a.variants.split(",")
    engines = {v: make_engine(model, v, base) for v in variants}
    times: dict = {v: {w: [] for w in work} for v in variants}
    ref: dict = {}
    try:
        for eng in engines.values():  # warm up each engine once
            asyncio.run(run_workload(eng, prompts[:2], sp, True))
        for r in range(a.rounds):
            for w, (ps, stream) in work.items():
                for v in (variants if r % 2 == 0 else variants[::-1]):
                    dt, outs = asyncio.run(run_workload(engines[v], ps, sp, stream))
                    assert ref.setdefault(w, outs) == outs, f"{v} {w}: tokens differ from {variants[0]}'s"
                    times[v][w].append(dt)
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
        stats = {v: {k: x for k, x in e.stats().items() if k.startswith("handoff_")} for v, e in engines.items()}
    finally:
        for eng in engines.values():
            eng.shutdown()
    toks = {w: len(ps) * a.output_tokens for w, (ps, _) in work.items()}
    summary = {v: {w: {"median_s": statistics.median(ts), "tokens_per_s": toks[w] / statistics.median(ts)}
                   for w, ts in times[v].items()} for v in variants}
    res = {"args": vars(a), "summary": summary, "times_s": times, "handoff_stats": stats}
    base_v = variants[0]
    lines = ["| variant | " + " | ".join(f"{w} tok/s (vs {base_v})" for w in work) + " | waits | wait s | timeouts |",
             "|---|" + "---|" * (len(work) + 3)]
    for v in variants:
        tps = {w: summary[v][w]["tokens_per_s"] for w in work}
        cells = [f"{tps[w]:.0f} ({tps[w] / summary[base_v][w]['tokens_per_s'] - 1:+.1%})" for w in work]
        s = stats[v]
        lines.append(f"| {v} | " + " | ".join(cells) + f" | {s['handoff_waits']} | {s['handoff_wait_s']:.3f} | "
                     f"{s['handoff_timeouts']} |")
    print("\n".join(lines))
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
