"""Config.prune_last_layer offline: the last decoder layer past its KV store on the sampled rows only (issue 19), on a
no-reuse-like burst, A-B-B-A in one process.

One engine, built with the flag on (so any startup compile the pruned path needs is done), and its runner's flag
toggled between rounds: the flag changes nothing but the eager branch of ModelRunner.launch, and a fresh 8B engine
per round would spend a minute of device time on dummy weights, warmups and graph captures. Prefix caching is off
by default so every round computes the same steps and the tokens of every round can be compared with the first's.
The end-to-end one-flag A/B is `bash bench/device_run.sh burst no-reuse engine,engine-noprune`.

Printed per mode: median req/s of its rounds, median ms of a step with prefill tokens (steps with more tokens than
the burst has requests), and whether every round's tokens equal round 0's.

    python -m bench.prune_ab --out prune.json                     # Llama-3.1-8B shapes, dummy weights (a GPU)
    python -m bench.prune_ab --model tiny --prompts 4 --prompt-tokens 300 --max-num-batched-tokens 256   # CPU
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

import numpy as np

from bench.provenance import write_json
from flame_llm import LLM, SamplingParams

MODEL = os.path.join(os.path.dirname(__file__), "..", "configs", "models", "llama-3.1-8b")


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one_round(llm: LLM, prompts: list[list[int]], out_tokens: int) -> dict:
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    _sync()
    t0 = last = time.perf_counter()
    seqs = [eng.add_request(p, sp) for p in prompts]
    prefill_ms: list[float] = []
    steps = 0
    while not eng.is_finished():
        _, tokens = eng.step()
        now = time.perf_counter()
        if tokens > len(prompts):  # carries prefill tokens
            prefill_ms.append((now - last) * 1e3)
        last = now
        steps += 1
    _sync()
    wall = time.perf_counter() - t0
    assert all(s.num_completion_tokens == out_tokens for s in seqs)
    return {"wall_s": round(wall, 4), "req_per_s": round(len(prompts) / wall, 4), "steps": steps,
            "prefill_steps": len(prefill_ms), "prefill_step_ms_p50": round(statistics.median(prefill_ms), 3)
            if prefill_ms else None, "tokens": [list(s.completion_token_ids) for s in seqs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL, help="a model dir (dummy weights from its config.json), or 'tiny'")
    p.add_argument("--out", default=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=8256)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=4, help="rounds in all, A-B-B-A order (after one warmup round each)")
    p.add_argument("--engine-json", default="{}", help="more engine fields (JSON object)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=a.max_num_batched_tokens,
              max_num_seqs=min(64, a.max_num_batched_tokens), max_model_len=32768, enable_prefix_caching=False,
              prune_last_layer=True)
    if a.model == "tiny":
        from flame_llm.models.tiny import make_tiny_model
        model = make_tiny_model(tempfile.mkdtemp(prefix="prune-ab-"), "llama")
        kw.update(max_model_len=4096, max_num_seqs=min(8, a.max_num_batched_tokens))
    else:
        model, kw["load_format"] = a.model, "dummy"
    kw.update(json.loads(a.engine_json))
    llm = LLM(model, **kw)
    runner = llm.engine.model_runner
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, llm.engine.vocab_size, a.prompt_tokens).tolist() for _ in range(a.prompts)]
    modes = {"off": False, "prune": True}
    warm = {}
    for prune in (False, True):  # warm both paths; the flag off's tokens are the reference
        runner.prune = prune
        warm[prune] = one_round(llm, prompts, a.output_tokens)["tokens"]
    ref = warm[False]
    order = (["off", "prune", "prune", "off"] * a.rounds)[: max(2, a.rounds)]
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    for mode in order:
        runner.prune = modes[mode]
        r = one_round(llm, prompts, a.output_tokens)
        tokens = r.pop("tokens")
        r["same_tokens_as_off"] = tokens == ref
        r["sequences_differing"] = sum(x != y for x, y in zip(tokens, ref))
        r["first_tokens_differing"] = sum(x[0] != y[0] for x, y in zip(tokens, ref))
        rows[mode].append(r)
    runner.prune = True
    summary = {m: {"req_per_s": statistics.median(r["req_per_s"] for r in rs),
                   "prefill_step_ms_p50": statistics.median(r["prefill_step_ms_p50"] or 0.0 for r in rs),
                   "tokens_equal": all(r["same_tokens_as_off"] for r in rs)} for m, rs in rows.items()}
    speedup = summary["prune"]["req_per_s"] / summary["off"]["req_per_s"]
    out = {"config": {**kw, "model": model, **{k: v for k, v in vars(a).items() if k not in ("out", "engine_json")}},
           "backend": runner.backend, "cuda_graphs": runner.use_graphs, "order": order, "rounds": rows,
           "summary": summary, "prune_over_off_req_per_s": round(speedup, 4)}
    write_json(a.out, out)
    print("| mode | req/s (median) | prefill step ms p50 | tokens equal every round |")
    print("|---|---|---|---|")
    for m, s in summary.items():
        print(f"| {m} | {s['req_per_s']:.3f} | {s['prefill_step_ms_p50']:.2f} | {s['tokens_equal']} |")
    print(f"prune / off req/s: {speedup:.4f}")


if __name__ == "__main__":
    main()
