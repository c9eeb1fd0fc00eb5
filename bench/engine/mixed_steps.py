"""Steps that carry a short prefill among decodes, eager vs replayed from a CUDA graph (Config.cuda_graph_mixed_tokens),
in one engine and one process: the A/B toggles the runner's mixed graphs between rounds (A-B-B-A...).

A round is the load benchmark's shape at a few streams: documents cached beforehand, `--streams` requests decoding
`--stream-tokens` tokens, and every `--every` steps a new question (`--question-tokens` over a cached document,
`--answer-tokens` out). Printed per mode: median wall time of steps with prefill tokens and of decode-only steps,
the questions' time to first token (from add to the step that sampled it), and the round's wall time.

    python -m bench.engine.mixed_steps --out mixed.json            # Llama-3.1-8B shapes, dummy weights (a GPU)
    python -m bench.engine.mixed_steps --model DIR --doc-tokens 256 --rounds 2   # any model (CPU: the padded path)
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

import numpy as np

from bench import MODELS
from bench.provenance import write_json
from flame_llm import LLM, SamplingParams

MODEL = os.path.join(MODELS, "llama-3.1-8b")


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one_round(llm: LLM, docs: list[list[int]], rng: np.random.Generator, a: argparse.Namespace) -> dict:
    eng = llm.engine
    vocab = eng.vocab_size
    streams = [eng.add_request(docs[i % len(docs)] + rng.integers(0, vocab, a.question_tokens).tolist(),
                               SamplingParams(temperature=0, max_tokens=a.stream_tokens, ignore_eos=True))
               for i in range(a.streams)]
    questions: list[tuple[float, object]] = []
    ttft: list[float] = []
    mixed_ms: list[float] = []
    decode_ms: list[float] = []
    step = 0
    _sync()
    t0 = last = time.perf_counter()
    while not eng.is_finished():
        if step % a.every == 0 and len(questions) < a.questions:
            ids = docs[len(questions) % len(docs)] + rng.integers(0, vocab, a.question_tokens).tolist()
            sp = SamplingParams(temperature=0, max_tokens=a.answer_tokens, ignore_eos=True)
            questions.append((time.perf_counter(), eng.add_request(ids, sp)))
        _, tokens = eng.step()
        now = time.perf_counter()
        (mixed_ms if tokens > a.streams + len(questions) else decode_ms).append((now - last) * 1e3)
        last = now
        step += 1
        for i, (t_add, seq) in enumerate(questions):
            if seq is not None and seq.num_completion_tokens >= 1:
                ttft.append((now - t_add) * 1e3)
                questions[i] = (t_add, None)
    _sync()
    assert all(s.num_completion_tokens == a.stream_tokens for s in streams)
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    return {"round_s": round(time.perf_counter() - t0, 4), "steps": step, "mixed_step_ms_p50": med(mixed_ms),
            "decode_step_ms_p50": med(decode_ms), "ttft_ms_p50": med(ttft), "ttft_ms_max": max(ttft, default=None),
            "mixed_steps": len(mixed_ms), "questions": len(ttft)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--out", default=None)
    p.add_argument("--mixed-tokens", type=int, default=512, help="cuda_graph_mixed_tokens of the graphed mode")
    p.add_argument("--engine-json", default="{}", help="more engine fields (JSON object)")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=8192)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=96)
    p.add_argument("--questions", type=int, default=12)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--every", type=int, default=6, help="steps between questions")
    p.add_argument("--rounds", type=int, default=4, help="per mode, alternating A-B-B-A")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    kw = dict(load_format="dummy", enable_chunked_prefill=True, max_num_batched_tokens=8192, max_num_seqs=64,
              max_model_len=32768, enable_prefix_caching=True, cuda_graph_mixed_tokens=a.mixed_tokens)
    kw.update(json.loads(a.engine_json))
    llm = LLM(a.model, **kw)
    runner = llm.engine.model_runner
    graphs = runner.mixed
    assert graphs is not None, "this engine makes no mixed-step graphs (torch backend or enforce_eager?)"
    rng = np.random.default_rng(0)
    vocab = llm.engine.vocab_size
    docs = [rng.integers(0, vocab, a.doc_tokens).tolist() for _ in range(a.docs)]
    llm.generate(docs, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)  # cache them
    rows: dict[str, list[dict]] = {"eager": [], "graphs": []}
    order = ["eager", "graphs", "graphs", "eager"] * ((a.rounds + 1) // 2)
    one_round(llm, docs, rng, a)  # warm both paths' first use
    for mode in order[: 2 * a.rounds]:
        runner.mixed = graphs if mode == "graphs" else None
        before = graphs.replays
        r = one_round(llm, docs, rng, a)
        r["replays"] = graphs.replays - before
        rows[mode].append(r)
    runner.mixed = graphs
    summary = {m: {k: statistics.median(r[k] for r in rs) for k in ("round_s", "mixed_step_ms_p50",
                                                                       "decode_step_ms_p50", "ttft_ms_p50")}
               for m, rs in rows.items()}
    out = {"config": {**kw, **{k: v for k, v in vars(a).items() if k not in ("out", "engine_json")}},
           "backend": runner.backend, "cuda_graphs": runner.use_graphs, "rounds": rows, "summary": summary}
    write_json(a.out, out)
    print("| mode | round s | step with prefill ms p50 | decode step ms p50 | question TTFT ms p50 |")
    print("|---|---|---|---|---|")
    for m, s in summary.items():
        print(f"| {m} | {s['round_s']:.3f} | {s['mixed_step_ms_p50']} | {s['decode_step_ms_p50']} | "
              f"{s['ttft_ms_p50']} |")


if __name__ == "__main__":
    main()
