"""What the host spends launching each kind of step, and the gaps a decoding stream sees around a long prefill.

On the H200 a miss's 8K-token prefill among decoding streams (load mode, Zipf-hot documents, 8 req/s) shows as
three inter-token gaps: flame 45 / 168 / 9 ms, vLLM 30 / 181 / 29 (medians over the window's misses). The first,
a decode step's gap, is where flame's ITL p99 lands (40.7 vs 33.1 ms). With asynchronous scheduling a step's
tokens are read only once the next step is launched, so a decode step's tokens wait for the host to enqueue the
long step after it: if that takes ~40 ms, the first gap is the decode step plus the launch. This probe measures
that directly, in one engine (asynchronous scheduling, as serving runs it):

- host pass: before every launch the GPU is kept busy (`torch.cuda._sleep`, --busy-ms), so the time `launch`
  takes on the host is enqueueing alone; a launch that takes the whole busy time waited for the GPU (a sync
  inside it). Eager steps also get their host time split by layer part (norms, projections, RoPE, attention
  with its K/V store, SiLU-mul; input upload, sampling; the rest).
- stream passes: no busy time; each step's host launch time and the gaps of one decoding stream around the miss,
  with emit_before_long_launch off and at --early (asynchronous scheduling only: a GPU): the gap before the miss's
  long step should shrink to a decode step's with it on.

Each pass: --docs documents of --doc-tokens cached, --streams streams over them decoding, then one 64-token
question (a short prefill: mixed CUDA graph), --burst questions at once (a longer short prefill: eager), and one
fresh --doc-tokens prompt (the miss: eager, chunked) at fixed steps.

    python -m bench.engine.launch_cost --out launch.json                      # Llama-3.1-8B shapes, dummy weights (GPU)
    python -m bench.engine.launch_cost --model tiny --doc-tokens 600 --streams 4 --burst 3 --steps 24 \\
        --max-num-batched-tokens 512                                   # CPU: the figures mean nothing there
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import torch

from bench import MODELS
from bench.provenance import write_json
from flame_llm import LLM, SamplingParams
from flame_llm.engine import model_runner as model_runner_mod
from flame_llm.layers.attention import Attention
from flame_llm.layers.layers import Linear, RMSNorm, RotaryEmbedding, SiluAndMul
from flame_llm.models.tiny import resolve_model

MODEL = os.path.join(MODELS, "llama-3.1-8b")
# (part, class, method): the leaves of a decoder layer (Linear covers MergedLinear; forward_kept is the pruned
# last layer's attention)
PARTS = [("attention (+ K/V store)", Attention, "forward"), ("attention (+ K/V store)", Attention, "forward_kept"),
         ("projections (GEMMs)", Linear, "forward"), ("RMSNorm", RMSNorm, "forward"),
         ("RoPE", RotaryEmbedding, "forward"), ("SiLU-mul", SiluAndMul, "forward")]


class Probe:
    """Wraps the runner's step launch (and the layer parts' forwards, counted while one runs) with host timers."""

    def __init__(self, runner, busy_cycles: int) -> None:
        self.runner, self.busy_cycles = runner, busy_cycles
        self.steps: list[dict] = []
        self.parts: dict[str, float] = defaultdict(float)
        self._undo: list = []

    def _wrap(self, owner, name: str, key: str) -> None:
        orig = getattr(owner, name)
        probe = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                probe.parts[key] += time.perf_counter() - t0
        setattr(owner, name, timed)
        self._undo.append((owner, name, orig))

    def __enter__(self) -> Probe:
        for key, cls, method in PARTS:
            self._wrap(cls, method, key)
        self._wrap(self.runner, "upload", "input upload")
        self._wrap(model_runner_mod, "sample_rows", "sampling")
        self._wrap_launch()
        return self

    def _wrap_launch(self) -> None:
        """The engine prepares a step (prepare_launch: its inputs on the host) and enqueues it (launch_prepared);
        both count as the launch's host time."""
        r, probe = self.runner, self
        prepare, enqueue = r.prepare_launch, r.launch_prepared
        prepared_s: dict[int, float] = {}

        def prepare_launch(scheduled, prev=None):
            t0 = time.perf_counter()
            p = prepare(scheduled, prev)
            prepared_s[id(p)] = time.perf_counter() - t0
            return p

        def launch_prepared(p):
            if probe.busy_cycles:
                torch.cuda._sleep(probe.busy_cycles)  # the GPU stays busy past the enqueueing below
            probe.parts = defaultdict(float)
            t0 = time.perf_counter()
            handle = enqueue(p)
            host = time.perf_counter() - t0 + prepared_s.pop(id(p), 0.0)
            s = p.scheduled
            row = {"tokens": s.total_num_scheduled_tokens, "seqs": len(s.seqs), "prefill": bool(s.has_prefill),
                   "path": p.path, "host_ms": host * 1e3}
            if p.path == "eager":
                row["parts_ms"] = {k: v * 1e3 for k, v in probe.parts.items()}
                row["parts_ms"]["rest"] = row["host_ms"] - sum(row["parts_ms"].values())
            probe.steps.append(row)
            return handle
        for name, fn in (("prepare_launch", prepare_launch), ("launch_prepared", launch_prepared)):
            setattr(r, name, fn)
            self._undo.append((r, name, None))

    def __exit__(self, *exc) -> None:
        for owner, name, orig in reversed(self._undo):
            if orig is None:
                delattr(owner, name)  # an instance attribute set above: the class's method again
            else:
                setattr(owner, name, orig)


def busy_cycles_for(ms: float) -> int:
    """torch.cuda._sleep cycles that keep this GPU busy about `ms` milliseconds (0 without CUDA)."""
    if not torch.cuda.is_available() or ms <= 0:
        return 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / start.elapsed_time(end))


def run_pass(llm: LLM, a, docs: list[list[int]], rng: np.random.Generator, busy_cycles: int, early: int = 0) -> dict:
    """One pass of the scenario; `early`: the engine's emit_before_long_launch meanwhile (steps are run with an
    on_commit hook, as serving runs them, so it applies where scheduling is asynchronous)."""
    eng = llm.engine
    vocab = eng.vocab_size

    def question(doc: list[int]) -> list[int]:
        return doc + rng.integers(0, vocab, a.question_tokens).tolist()

    def on_commit(finished) -> None:  # serving hands tokens out here; the stream's token_times are these moments
        pass

    long = SamplingParams(temperature=0, max_tokens=a.steps + 64, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    streams = [eng.add_request(question(docs[i % len(docs)]), long) for i in range(a.streams)]
    while any(s.num_completion_tokens == 0 for s in streams):  # every stream past its prefill
        eng.step(on_commit)
    events = {a.steps // 4: "question", a.steps // 2: "burst", (3 * a.steps) // 4: "miss"}
    marks: dict[str, int] = {}
    miss_at = None
    built = eng.emit_before_long_launch
    eng.emit_before_long_launch = early
    try:
        with Probe(eng.model_runner, busy_cycles) as probe:
            for i in range(a.steps):
                what = events.get(i)
                if what == "question":
                    eng.add_request(question(docs[0]), short)
                elif what == "burst":
                    for j in range(a.burst):
                        eng.add_request(question(docs[j % len(docs)]), short)
                elif what == "miss":
                    eng.add_request(rng.integers(0, vocab, a.doc_tokens + a.question_tokens).tolist(), short)
                    miss_at = time.perf_counter()
                if what:
                    marks[what] = len(probe.steps)
                eng.step(on_commit)
    finally:
        eng.emit_before_long_launch = built
    for s in streams:
        eng.abort(s.request_id)
    while not eng.is_finished():
        eng.step(on_commit)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = streams[0].token_times
    gaps = [(b - t) * 1e3 for t, b in zip(times, times[1:])]
    return {"early": early, "steps": probe.steps, "marks": marks, "stream_gaps_ms": gaps,
            "around_miss_ms": around_miss(times, miss_at)}


def around_miss(times: list[float], miss_at: float | None) -> dict | None:
    """Stream gaps at the miss: the longest gap ending after it arrived, and the gaps just before and after."""
    if miss_at is None:
        return None
    gaps = [(i, (b - t) * 1e3) for i, (t, b) in enumerate(zip(times, times[1:])) if b > miss_at]
    if not gaps:
        return None
    i, long = max(gaps, key=lambda g: g[1])
    all_gaps = [(b - t) * 1e3 for t, b in zip(times, times[1:])]
    return {"before_ms": all_gaps[i - 1] if i > 0 else None, "long_ms": long,
            "after_ms": all_gaps[i + 1] if i + 1 < len(all_gaps) else None}


def summarize(host: dict, streams: list[dict], busy_ms: float) -> dict:
    by_path: dict[str, list[float]] = defaultdict(list)
    for s in host["steps"]:
        kind = s["path"] if s["path"] != "eager" else f"eager, {'>' if s['tokens'] > 2048 else '<='} 2048 tokens"
        by_path[kind].append(s["host_ms"])
    paths = {k: {"n": len(v), "host_ms_p50": statistics.median(v), "host_ms_max": max(v)} for k, v in by_path.items()}
    parts: dict[str, dict[str, float]] = {}
    for kind in ("eager, <= 2048 tokens", "eager, > 2048 tokens"):
        rows = [s["parts_ms"] for s in host["steps"] if s["path"] == "eager"
                and (s["tokens"] > 2048) == kind.startswith("eager, >")]
        if rows:
            parts[kind] = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0]}
    synced = [i for i, s in enumerate(host["steps"]) if busy_ms and s["host_ms"] >= 0.9 * busy_ms]
    stream = streams[0]
    miss = stream["marks"].get("miss", 0)
    around = [{"step": i - miss, **stream["steps"][i]} for i in range(max(0, miss - 2), min(miss + 4,
                                                                                         len(stream["steps"])))]
    return {"paths": paths, "eager_parts_ms_p50": parts, "launches_that_waited_for_the_gpu": synced,
            "steps_around_the_miss": around, "stream_gaps_ms": stream["stream_gaps_ms"],
            "gaps_at_the_miss_ms": {str(p["early"]): p["around_miss_ms"] for p in streams}}


def table(s: dict, busy_ms: float) -> str:
    lines = ["| step kind | launches | host ms p50 | host ms max |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['n']} | {v['host_ms_p50']:.2f} | {v['host_ms_max']:.2f} |" for k, v in s["paths"].items()]
    for kind, parts in s["eager_parts_ms_p50"].items():
        lines += ["", f"| {kind}: host ms by part (p50) | ms |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in parts.items()]
    lines += ["", "| stream pass: step (the miss arrives before 0) | tokens | path | host ms |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['tokens']} | {r['path']} | {r['host_ms']:.2f} |" for r in s["steps_around_the_miss"]]
    gaps = s["stream_gaps_ms"]
    if gaps:
        top = sorted(gaps, reverse=True)[:4]
        lines.append(f"\nstream 0's inter-token gaps: p50 {statistics.median(gaps):.2f} ms, longest "
                     + " / ".join(f"{g:.1f}" for g in top) + " ms")
    for early, g in s["gaps_at_the_miss_ms"].items():
        if g:
            ms = " / ".join("n/a" if g[k] is None else f"{g[k]:.1f}" for k in ("before_ms", "long_ms", "after_ms"))
            lines.append(f"stream 0 at the miss, emit_before_long_launch {early}: gap before / long / after {ms} ms")
    if busy_ms:
        waited = s["launches_that_waited_for_the_gpu"]
        lines.append(f"launches that waited for the GPU (host >= 90% of the {busy_ms:.0f} ms busy time): "
                     + (", ".join(map(str, waited)) if waited else "none"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine.launch_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL, help="a model dir (dummy weights from its config.json), or 'tiny'")
    p.add_argument("--out", default=None)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=8192)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--burst", type=int, default=12, help="questions added at once (12 x 64 > the 512-token graphs)")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--busy-ms", type=float, default=200.0, help="GPU busy time before each launch, host pass")
    p.add_argument("--early", type=int, default=2048, help="emit_before_long_launch of the second stream pass")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--engine-json", default="{}", help="more engine fields (JSON object)")
    a = p.parse_args(argv)
    import json
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=64,
              max_model_len=32768, enable_prefix_caching=True)
    if a.model == "tiny":
        model = resolve_model("tiny")  # the embedded default checkpoint
        kw.update(max_model_len=4096, max_num_seqs=max(8, a.streams + a.burst + 2))
    else:
        model, kw["load_format"] = a.model, "dummy"
    kw.update(json.loads(a.engine_json))
    llm = LLM(model, **kw)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, llm.engine.vocab_size, a.doc_tokens).tolist() for _ in range(a.docs)]
    llm.generate(docs, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # cached from here on
    busy = busy_cycles_for(a.busy_ms)
    runner = llm.engine.model_runner
    host = run_pass(llm, a, docs, rng, busy)
    streams = [run_pass(llm, a, docs, rng, 0, early) for early in (0, a.early)]
    busy_ms = a.busy_ms if busy else 0.0
    s = summarize(host, streams, busy_ms)
    write_json(a.out, {"config": {**kw, "model": model, **{k: v for k, v in vars(a).items() if k != "out"}},
                       "backend": runner.backend, "cuda_graphs": runner.use_graphs,
                       "async_scheduling": llm.engine.async_scheduling, "summary": s,
                       "host_pass": host, "stream_passes": streams})
    print(table(s, busy_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
