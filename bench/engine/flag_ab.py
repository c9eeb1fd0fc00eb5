"""One runner flag offline (issue 19): `prune_last_layer` (the last decoder layer past its KV store on the sampled
rows only), on a no-reuse-like burst, A-B-B-A in one process. (Its other flags, mlp_row_split_tokens,
fa4_call_reuse and gemm_lt_min_tokens, measured flat and were retired: bench/KERNELS.md, "Tried and retired".)

One engine, built with the flag at its `--on` value, and the flag toggled on the live engine between rounds. That is
all the flag changes once the engine runs: prune_last_layer is read by ModelRunner.launch's eager branch each step
(runner.prune; at startup it also warms the decode kernel the kept rows take, hence building with it on). A fresh 8B
engine per round would spend a minute of device time on dummy weights, warmups and graph captures. Prefix caching is
off by default so every round computes the same steps and the tokens of every round can be compared with the
flag-off warmup round's. The end-to-end one-flag A/B is `bash bench/device_run.sh burst no-reuse engine,engine-noprune`.

Printed per mode: median req/s of its rounds, median ms of a step with prefill tokens (steps with more tokens than
the burst has requests), and whether every round's tokens equal the flag off's.

    python -m bench.engine.flag_ab --flag prune_last_layer --out prune.json
    python -m bench.engine.flag_ab --model tiny --prompts 4 --prompt-tokens 300 --max-num-batched-tokens 256  # CPU
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bench import MODELS
from bench.provenance import write_json
from flame_llm import LLM, SamplingParams
from flame_llm.engine.model_runner import ModelRunner
from flame_llm.models.tiny import resolve_model

MODEL = os.path.join(MODELS, "llama-3.1-8b")


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")


def _set_prune(runner: ModelRunner, value: bool) -> None:
    runner.prune = value


@dataclass(slots=True, frozen=True)
class Flag:
    mode: str  # the flag-on mode's name in the table and the JSON
    parse: Callable[[str], object]
    apply: Callable[[ModelRunner, object], None]  # sets the flag on the live engine
    on: str  # --on / --off defaults
    off: str


FLAGS = {"prune_last_layer": Flag("prune", _bool, _set_prune, "true", "false")}


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


def main(argv: list[str] | None = None, prog: str = "python -m bench.engine.flag_ab") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--flag", choices=sorted(FLAGS), default="prune_last_layer")
    p.add_argument("--on", default=None, help="the flag's value in the 'on' mode (default: true)")
    p.add_argument("--off", default=None, help="its value in the 'off' mode, the tokens' reference (false / 0)")
    p.add_argument("--model", default=MODEL, help="a model dir (dummy weights from its config.json), or 'tiny'")
    p.add_argument("--out", default=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=8256)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=4, help="rounds in all, A-B-B-A order (after one warmup round each)")
    p.add_argument("--engine-json", default="{}", help="more engine fields (JSON object)")
    a = p.parse_args(argv)
    flag = FLAGS[a.flag]
    try:
        on, off = flag.parse(a.on or flag.on), flag.parse(a.off or flag.off)
    except ValueError as e:
        p.error(f"--on/--off of {a.flag}: {e}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=a.max_num_batched_tokens,
              max_num_seqs=min(64, a.max_num_batched_tokens), max_model_len=32768, enable_prefix_caching=False)
    if a.model == "tiny":
        model = resolve_model("tiny")  # the embedded default checkpoint
        kw.update(max_model_len=4096, max_num_seqs=min(8, a.max_num_batched_tokens))
    else:
        model, kw["load_format"] = a.model, "dummy"
    kw.update(json.loads(a.engine_json))
    kw[a.flag] = on  # checked by the config like any engine field
    llm = LLM(model, **kw)
    runner = llm.engine.model_runner
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, llm.engine.vocab_size, a.prompt_tokens).tolist() for _ in range(a.prompts)]
    modes = {"off": off, flag.mode: on}
    warm = {}
    for mode, value in modes.items():  # warm both paths; the flag off's tokens are the reference
        flag.apply(runner, value)
        warm[mode] = one_round(llm, prompts, a.output_tokens)["tokens"]
    ref = warm["off"]
    order = (["off", flag.mode, flag.mode, "off"] * a.rounds)[: max(2, a.rounds)]
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    for mode in order:
        flag.apply(runner, modes[mode])
        r = one_round(llm, prompts, a.output_tokens)
        tokens = r.pop("tokens")
        r["same_tokens_as_off"] = tokens == ref
        r["sequences_differing"] = sum(x != y for x, y in zip(tokens, ref))
        r["first_tokens_differing"] = sum(x[0] != y[0] for x, y in zip(tokens, ref))
        rows[mode].append(r)
    flag.apply(runner, on)  # the engine as built
    summary = {m: {"req_per_s": statistics.median(r["req_per_s"] for r in rs),
                   "prefill_step_ms_p50": statistics.median(r["prefill_step_ms_p50"] or 0.0 for r in rs),
                   "tokens_equal": all(r["same_tokens_as_off"] for r in rs)} for m, rs in rows.items()}
    speedup = summary[flag.mode]["req_per_s"] / summary["off"]["req_per_s"]
    out = {"config": {**kw, "model": model, **{k: v for k, v in vars(a).items() if k not in ("out", "engine_json")}},
           "flag": a.flag, "on": on, "off": off, "backend": runner.backend, "cuda_graphs": runner.use_graphs,
           "order": order, "rounds": rows, "summary": summary, f"{flag.mode}_over_off_req_per_s": round(speedup, 4)}
    write_json(a.out, out)
    print(f"{a.flag}: {flag.mode} = {on}, off = {off}")
    print("| mode | req/s (median) | prefill step ms p50 | tokens equal every round |")
    print("|---|---|---|---|")
    for m, s in summary.items():
        print(f"| {m} | {s['req_per_s']:.3f} | {s['prefill_step_ms_p50']:.2f} | {s['tokens_equal']} |")
    print(f"{flag.mode} / off req/s: {speedup:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
