"""Decode attention with and without shared-prefix segments (RunnerConfig.shared_prefix_decode), kernel alone.

    python -m bench.shared_prefix_probe --out $OUT/shared.json      (under a minute on an H200)

The reuse trace decodes 64 rows at a time whose 8,192-token documents are shared by four questions each, and the
usual decode kernel reads each document's K/V once per question: at Llama-3.1-8B's layout (8 KV heads of 128,
bf16) a layer's decode step reads 64 x 8,256 x 8 x 128 x 2 x 2 B = 2.2 GB, ~0.45 ms at 4.8 TB/s; read once per
document it is a quarter of that. Per case (rows = docs x questions; each row's own tail after the shared blocks)
this times the usual kernel and the shared-prefix one (median of --reps CUDA-event timings, inputs rotated over
--rotate caches so L2 holds none), their output difference, and the bandwidth each reaches counting each K/V byte
read once per row (usual) and the bytes the shared path must read. `--device cpu --docs 2 --questions 2
--doc-blocks 2 --reps 1 --rotate 1` runs the code path on CPU (interpreter; no figure)."""
from __future__ import annotations

import argparse
import logging
import statistics
import sys

import numpy as np
import torch

from bench.provenance import write_json

log = logging.getLogger(__name__)


def _case(docs: int, questions: int, doc_blocks: int, block_size: int, heads: int, kv_heads: int, dim: int,
          device: str, dtype: torch.dtype, rng: np.random.Generator):
    from flame_llm.kernels.metadata import AttentionMetadata

    tables, lens, nxt = [], [], 0
    for _ in range(docs):
        prefix = list(range(nxt, nxt + doc_blocks))
        nxt += doc_blocks
        for _ in range(questions):  # a 64-token question and up to 16 answer tokens in blocks of its own
            own = int(rng.integers(65, 81))
            n_own = -(-own // block_size)
            tables.append(prefix + list(range(nxt, nxt + n_own)))
            nxt += n_own
            lens.append(doc_blocks * block_size + own)
    order = rng.permutation(len(lens))
    bt, sl = np.asarray(tables, dtype=np.int32)[order], np.asarray(lens, dtype=np.int32)[order]
    k = torch.randn(nxt, block_size, kv_heads, dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    q = torch.randn(len(lens), heads, dim, dtype=dtype, device=device)
    meta = AttentionMetadata(torch.arange(len(lens) + 1, dtype=torch.int32, device=device),
                             torch.from_numpy(sl).to(device), torch.from_numpy(bt).to(device),
                             torch.empty(0, dtype=torch.int64, device=device), 1, int(sl.max()), is_decode=True)
    return q, k, v, meta, bt, sl


def _time(fn, reps: int, device: str) -> float:
    if device == "cpu":
        return 0.0
    fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def _launch(case, shared, scale: float) -> torch.Tensor:
    """One decode-attention launch of a case: the usual kernel (shared None) or by the case's segments."""
    from flame_llm.kernels import triton_attention as ta

    q, k, v, meta, _, _ = case
    meta.shared = shared
    try:
        return ta.paged_attention_triton(q, k, v, meta, scale)
    finally:
        meta.shared = None


def _rotating(cases: list, shared: list, scale: float):
    """A launch function that takes the next of the rotated cases on each call (L2 holds none of them)."""
    state = {"i": 0}

    def fn():
        i = state["i"] % len(cases)
        state["i"] += 1
        return _launch(cases[i], shared[i], scale)
    return fn


def run(a: argparse.Namespace) -> list[dict]:
    from flame_llm.kernels import shared_prefix as sp

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    rng = np.random.default_rng(0)
    scale = 128 ** -0.5
    rows = []
    for questions in a.questions:
        cases = [_case(a.docs * a.questions[0] // questions, questions, a.doc_blocks, a.block_size, 32, 8, 128,
                       a.device, dtype, rng) for _ in range(a.rotate)]
        shared = []
        for case in cases:
            segs, n_shared, longest = sp.plan_segments(case[4], case[5], a.block_size)
            shared.append(sp.SharedPrefix(torch.from_numpy(segs).to(a.device), n_shared, longest))
        usual, with_shared = _rotating(cases, [None] * len(cases), scale), _rotating(cases, shared, scale)
        t_usual, t_shared = [], []
        for _ in range(a.rounds):  # A-B rounds: clocks and heat fall on both
            t_usual.append(_time(usual, a.reps, a.device))
            t_shared.append(_time(with_shared, a.reps, a.device))
        o_usual, o_shared = _launch(cases[0], None, scale), _launch(cases[0], shared[0], scale)
        k, sl = cases[0][1], cases[0][5]
        kv_row = 8 * 128 * 2 * k.element_size()  # K and V bytes of one key position, one layer
        bytes_usual = int(sl.sum()) * kv_row
        doc_keys = a.doc_blocks * a.block_size
        bytes_shared = ((len(sl) // questions * doc_keys + int((sl - doc_keys).sum())) * kv_row if questions > 1
                        else bytes_usual)
        u, s = statistics.median(t_usual), statistics.median(t_shared)
        row = {"rows": len(sl), "questions_per_doc": questions, "doc_tokens": doc_keys,
               "usual_ms": u * 1e3, "shared_ms": s * 1e3, "speedup": u / s if s else None,
               "usual_tb_s": bytes_usual / u / 1e12 if u else None,
               "shared_tb_s_of_needed": bytes_shared / s / 1e12 if s else None, "num_shared": shared[0].num_shared,
               "max_rel_diff": ((o_shared.float() - o_usual.float()).norm() / o_usual.float().norm()).item()}
        rows.append(row)
        log.info("%s", row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.shared_prefix_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--questions", type=lambda s: [int(x) for x in s.split(",")], default=[4, 1, 2, 8],
                   help="questions per document, one case each (rows = docs x the first value in every case)")
    p.add_argument("--doc-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rotate", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = run(a)
    write_json(a.out, {"argv": sys.argv, "rows": rows})
    print("| rows | questions/doc | usual ms | shared ms | speedup | usual TB/s | shared TB/s (needed bytes) "
          "| rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = (lambda x, n=3: "-" if x is None else f"{x:.{n}f}")
        print(f"| {r['rows']} | {r['questions_per_doc']} | {f(r['usual_ms'])} | {f(r['shared_ms'])} | "
              f"{f(r['speedup'])} | {f(r['usual_tb_s'], 2)} | {f(r['shared_tb_s_of_needed'], 2)} | "
              f"{r['max_rel_diff']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
