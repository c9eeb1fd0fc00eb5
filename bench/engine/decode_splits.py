"""Split-KV of our Triton decode attention at the batch sizes a load runs (issue 39), as a decode CUDA graph runs it.

Under load on the H200 our decode steps carried ~19 rows at ~8K context and came ~2 ms later than vLLM's, while the
isolated profile's points (8, 16, 32, 64 rows) were within 3%. A decode graph of bucket b (engine/cuda_graphs.py:
1, 2, 4, 8, then every 16) fixes its split count at capture from b x kv heads programs (pick_num_splits: no split
once that reaches the SM count), so 19 rows replay bucket 32's graph with 1 split: 152 programs of 8K keys each on
132 SMs, where 16 rows (bucket 16) get 2 splits of 4K keys. This times one layer's decode attention per (rows,
context, splits), rows padded to their bucket as the graph pads them, in CUDA graphs over several distinct caches
(so L2 cannot hold the KV): the split count the engine picks against the best one.

    python -m bench.engine.decode_splits --out $OUT/splits.json [--rows 8,12,16,17,20,24,28,32,40,48,64]
"""
from __future__ import annotations

import argparse
import json
import logging
import math

import torch
from triton.testing import do_bench_cudagraph

from bench.engine.gpu_kernels import HKV, D, make_batch
from flame_llm.engine.cuda_graphs import BUCKETS
from flame_llm.kernels import triton_attention as ta

log = logging.getLogger(__name__)
LAYERS = 32  # Llama-3.1-8B: a step's attention is this many layers


def bucket_of(rows: int, max_bs: int = 64) -> int:
    return min(b for b in sorted(set(BUCKETS) | set(range(16, max_bs + 1, 16)) | {max_bs}) if b >= rows)


def time_point(rows: int, ctx: int, splits: list[int], block_size: int, max_model_len: int) -> list[dict]:
    b = bucket_of(rows)
    kv_bytes = rows * ctx * HKV * D * 2 * 2
    copies = max(1, math.ceil(512e6 / kv_bytes))
    data = [make_batch([ctx] * rows, [1] * rows, block_size=block_size, pad_rows=b - rows, decode=True,
                       max_seqlen_k=max_model_len, seed=i) for i in range(copies)]
    scale = D ** -0.5
    sms = ta._sm_count(torch.device("cuda"))
    auto = ta.pick_num_splits(b * HKV, max_model_len, sms)
    out = []
    for s in sorted(set(splits) | {auto}):
        def fn(s=s, data=data):
            for q, _, _, kc, vc, meta in data:
                ta.paged_attention_triton(q, kc, vc, meta, scale, num_splits=s)
        us = 1e3 * do_bench_cudagraph(fn, rep=60, return_mode="median") / copies
        out.append({"rows": rows, "bucket": b, "ctx": ctx, "splits": s, "auto": s == auto, "us_per_layer": us,
                    "kv_gb_per_s": kv_bytes / us / 1e3})
        log.info("%s", out[-1])
    data.clear()
    torch.cuda.empty_cache()
    return out


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(r["rows"], r["ctx"]) for r in rows}):
        pts = [r for r in rows if (r["rows"], r["ctx"]) == key]
        auto = next(r for r in pts if r["auto"])
        best = min(pts, key=lambda r: r["us_per_layer"])
        out.append({"rows": key[0], "ctx": key[1], "bucket": auto["bucket"], "auto_splits": auto["splits"],
                    "auto_us": auto["us_per_layer"], "best_splits": best["splits"], "best_us": best["us_per_layer"],
                    "step_ms_saved": LAYERS * (auto["us_per_layer"] - best["us_per_layer"]) / 1e3})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine.decode_splits", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="8,12,16,17,20,24,28,32,40,48,64")
    p.add_argument("--contexts", default="4096,8192")
    p.add_argument("--splits", default="1,2,4,8,16")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=32768, help="what a decode graph is captured with")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    splits = [int(x) for x in a.splits.split(",")]
    rows = []
    for ctx in (int(x) for x in a.contexts.split(",")):
        for r in (int(x) for x in a.rows.split(",")):
            rows += time_point(r, ctx, splits, a.block_size, a.max_model_len)
    summary = summarize(rows)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "sms": ta._sm_count(torch.device("cuda")),
                   "args": vars(a), "points": rows, "summary": summary}, f, indent=1)
    log.info("| rows | ctx | bucket | auto splits | auto us/layer | best splits | best us/layer | step ms saved (x%d) |"
             "\n|---|---|---|---|---|---|---|---|\n%s", LAYERS, "\n".join(
                 f"| {s['rows']} | {s['ctx']} | {s['bucket']} | {s['auto_splits']} | {s['auto_us']:.1f} | "
                 f"{s['best_splits']} | {s['best_us']:.1f} | {s['step_ms_saved']:.2f} |" for s in summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
