"""A prediction, not a measurement: load mode's document-QA stream through one simulated shard (the real Scheduler
and BlockManager, a step-time model instead of kernels) with max_prefill_tokens_with_decode off and on, and what
each does to TTFT, TPOT and inter-token gaps. The step model's defaults are fitted to the H100 load run of session
23 (bench/RESULTS.md: decode graphs 7.6 / 9.3 / 12.0 ms at 4.7 / 11.1 / 26.1 rows of ~8K context; an 8K-token
prefill step ~200 ms), so it says where the GPU A/B (labels flame-chunk2k, engine-chunk2k) should land, no more.

    python -m bench.service.sim.prefill_cap --rates 8,12 --caps 0,2048,1024 --out cap.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict

import numpy as np

from bench.load.load_workloads import OutputLen, doc_weights, draw_doc
from bench.load.loadgen import arrivals
from bench.service.sim.shard import StepModel
from flame_llm.config import Config
from flame_llm.engine.block_manager import BlockManager
from flame_llm.engine.outputs import ModelRunnerOutput
from flame_llm.engine.scheduler import Scheduler
from flame_llm.engine.sequence import Sequence
from flame_llm.sampling_params import SamplingParams

log = logging.getLogger(__name__)
MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "models", "llama-3.1-8b")
H100 = StepModel(fixed_s=0.0066, prefill_token_s=0.024e-3, decode_row_s=0.2e-3)  # see the module docstring


def run(rate: float, cap: int, a: argparse.Namespace) -> dict:
    cfg = Config.from_kwargs(MODEL, max_model_len=16384, max_num_seqs=64, max_num_batched_tokens=8192,
                             max_prefill_tokens_with_decode=cap, block_size=128)
    sched = Scheduler(cfg, BlockManager(a.kv_tokens // 128, 128, True, True))
    rng = np.random.default_rng(a.seed)
    docs = rng.integers(0, 128256, size=(a.num_docs, a.doc_tokens))
    weights, lengths = doc_weights(a.num_docs, a.doc_zipf), OutputLen.parse(a.output_len)
    times = arrivals(rate, a.warmup_s + a.duration_s, a.seed)  # measured: arrivals after the warm-up
    reqs = []
    for i, t in enumerate(times):
        prompt = [*docs[draw_doc(rng, weights)].tolist(), *rng.integers(0, 128256, a.question_tokens).tolist()]
        sp = SamplingParams(temperature=0.0, max_tokens=lengths.draw(rng), ignore_eos=True)
        reqs.append((float(t), Sequence(prompt, sp, 128, f"r{i}")))
    tokens_at: dict[str, list[float]] = {}
    now, nxt = 0.0, 0
    while nxt < len(reqs) or not sched.is_finished():
        while nxt < len(reqs) and reqs[nxt][0] <= now:
            sched.add(reqs[nxt][1])
            tokens_at[reqs[nxt][1].request_id] = [reqs[nxt][0]]
            nxt += 1
        out = sched.schedule()
        if not out.seqs:
            now = reqs[nxt][0]
            continue
        rows = sum(1 for s, n in zip(out.seqs, out.num_scheduled_tokens) if n == 1 and s.num_completion_tokens)
        now += a.step.step_s(out.total_num_scheduled_tokens - rows, rows)
        sampled = [7 if s.num_pending_tokens > 0 else None for s in out.seqs]
        for s, t in zip(out.seqs, sampled):
            if t is not None:
                tokens_at[s.request_id].append(now)
        sched.update_from_output(ModelRunnerOutput(out, sampled))
    ttft, tpot, itl = [], [], []
    measured = [ts for ts in tokens_at.values() if ts[0] >= a.warmup_s]
    for ts in measured:
        ttft.append(ts[1] - ts[0])
        if len(ts) > 2:
            tpot.append((ts[-1] - ts[1]) / (len(ts) - 2))
            itl += np.diff(ts[1:]).tolist()

    def pct(xs: list[float]) -> dict:
        return {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99))}
    return {"rate": rate, "cap": cap, "requests": len(measured), "end_s": now, "ttft_s": pct(ttft), "tpot_s": pct(tpot),
            "itl_s": pct(itl), "steps": sched.stats()["num_prefill_steps"] + sched.stats()["num_decode_steps"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="8,12")
    p.add_argument("--caps", default="0,2048,1024")
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=30.0, help="the same stream before the measured window "
                   "(the GPU runs measure after a warm cache: 4, 8, then 12 req/s on one server)")
    p.add_argument("--num-docs", type=int, default=64)
    p.add_argument("--doc-tokens", type=int, default=8192)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--doc-zipf", type=float, default=1.2)
    p.add_argument("--output-len", default="qa")
    p.add_argument("--kv-tokens", type=int, default=414720, help="the H100 load run's KV capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    a.step = H100
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = [run(float(r), int(c), a) for r in a.rates.split(",") for c in a.caps.split(",")]
    log.info("| req/s | cap | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | steps | last token (s) |")
    log.info("|---|---|---|---|---|---|---|")
    for r in rows:
        log.info(f"| {r['rate']:g} | {r['cap']} | {r['ttft_s']['p50']:.3f} / {r['ttft_s']['p99']:.3f} | "
                 f"{r['tpot_s']['p50'] * 1e3:.1f} / {r['tpot_s']['p99'] * 1e3:.1f} | {r['itl_s']['p50'] * 1e3:.1f} / "
                 f"{r['itl_s']['p99'] * 1e3:.1f} | {r['steps']} | {r['end_s']:.2f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"step_model": asdict(a.step), "args": {k: v for k, v in vars(a).items() if k != "step"},
                       "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
