"""How much faster are Llama-3.1-8B's projections in FP8 than in bf16 on this GPU, at the step sizes we run? (issue 40)

    python -m bench.engine.fp8_gemm_probe --out $OUT/fp8_gemm.json      (about 1-2 minutes on an H200)

For each projection (qkv, o, gate/up, down) and each step size M (decode rows 1-256, prefill chunks to 8,192
tokens) it times, in interleaved rounds (A-B-C-...-C-B-A, so clocks and heat fall on every variant alike):

- `bf16`: F.linear on bf16 weights, as the engine runs today;
- `fp8_mm`: torch._scaled_mm on e4m3 operands with row-wise scales (per token for the activations, per output
  channel for the weights), the GEMM alone on already-quantized activations;
- `fp8_q+mm`: the same plus quantizing the bf16 activations per token with plain torch ops (amax, scale, cast),
  what an unfused layer pays; the gap between the two is what fusing the quantization into the producer can win;
- `w8a16` (M <= 64): our Triton kernel on e4m3 weights and bf16 activations (flame_llm/kernels/fp8_gemv.py), the
  fastest of a small sweep of tile/split configurations, checked against the dequantized weights' F.linear.

Each timing is a sustained run (`--calls` back-to-back calls over rotating inputs, so nothing stays in L2,
captured in a CUDA graph and replayed between two events, as the engine's decode steps run). Reported per
shape: TFLOP/s per variant (median of rounds), fp8 ÷ bf16 speed-ups, and the relative error of the fp8 product
against the bf16 one on random normal data (‖fp8 − bf16‖ / ‖bf16‖).
The last table sums a whole 32-layer model step at each M: bf16 ms, fp8 ms, speed-up. `--device cpu` is refused
(no FP8 GEMM there)."""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics

import torch
import torch.nn.functional as F
import triton

from flame_llm.kernels.fp8_gemv import fp8_small_m_linear

log = logging.getLogger("bench.engine.fp8_gemm_probe")
E4M3_MAX = 448.0
# (name, N, K) for Llama-3.1-8B: hidden 4096, 32 query / 8 KV heads of 128, intermediate 14,336
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per token, or per output channel) e4m3: returns (fp8 tensor, fp32 scales of shape (R, 1))."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def w8a16_configs(m: int) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) candidates for M rows."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    return [(bm, bn, bk, split, 4, stages) for bn, bk, split, stages in
            itertools.product((16, 32, 64), (128, 256), (1, 2, 4), (3, 5))]


def timed(fn, calls: int) -> float:
    """ms per call of `calls` back-to-back calls captured in one CUDA graph and replayed: small-M steps run
    under graphs in the engine, so Python's launch cost (~10 us for torch, more for a Triton launch) stays out."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def probe_shape(name: str, n: int, k: int, m: int, calls: int, rounds: int, sets: int) -> dict:
    dev = "cuda"
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(sets)]
    xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    wq = [quant_rows(w) for w in ws]  # (N, K) fp8, (N, 1) scales
    wqt = [(q.t(), s.t().contiguous()) for q, s in wq]  # column-major (K, N) operand, (1, N) scales
    xq = [quant_rows(x) for x in xs]

    def bf16(i):
        return F.linear(xs[i % sets], ws[i % sets])

    def fp8_mm(i):
        (a, sa), (b, sb) = xq[i % sets], wqt[i % sets]
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    def fp8_qmm(i):
        a, sa = quant_rows(xs[i % sets])
        b, sb = wqt[i % sets]
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    variants = {"bf16": bf16, "fp8_mm": fp8_mm, "fp8_q+mm": fp8_qmm}
    w8 = [(q, s.flatten().contiguous()) for q, s in wq]
    configs = w8a16_configs(m) if m <= 64 else []
    for cfg in configs:
        bm, bn, bk, split, warps, stages = cfg
        try:
            fp8_small_m_linear(xs[0], w8[0][0], w8[0][1], cfg[:4], num_warps=warps, num_stages=stages)
        except triton.runtime.errors.OutOfResources:
            continue
        variants[f"w8a16:{bm},{bn},{bk},{split},{warps},{stages}"] = (
            lambda i, cfg=cfg: fp8_small_m_linear(xs[i % sets], w8[i % sets][0], w8[i % sets][1], cfg[:4],
                                                  num_warps=cfg[4], num_stages=cfg[5]))
    ref = bf16(0).float()
    err = ((fp8_mm(0).float() - ref).norm() / ref.norm()).item()
    deq = F.linear(xs[0].float(), wq[0][0].float() * wq[0][1]).float()
    w8_err = {v: ((variants[v](0).float() - deq).norm() / deq.norm()).item() for v in variants if v[:5] == "w8a16"}
    order = list(variants)
    times: dict[str, list[float]] = {v: [] for v in order}
    for r in range(rounds):
        seq = order if r % 2 == 0 else order[::-1]
        for v in seq:
            times[v].append(timed(variants[v], calls))
    flops = 2.0 * m * n * k
    out = {"name": name, "m": m, "n": n, "k": k, "rel_err_fp8_vs_bf16": err}
    for v in order:
        ms = statistics.median(times[v])
        out[v] = {"ms": ms, "tflops": flops / ms / 1e9}
    out["speedup_mm"] = out["bf16"]["ms"] / out["fp8_mm"]["ms"]
    good = [v for v in w8_err if w8_err[v] < 1e-2]
    if good:
        best = min(good, key=lambda v: out[v]["ms"])
        out["w8a16_best"] = {"config": best, "ms": out[best]["ms"], "rel_err_vs_dequant": w8_err[best],
                             "speedup": out["bf16"]["ms"] / out[best]["ms"]}
    out["w8a16_errors"] = w8_err
    out["speedup_q+mm"] = out["bf16"]["ms"] / out["fp8_q+mm"]["ms"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,8,32,64,128,256,512,2048,4096,8192")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sets", type=int, default=4, help="rotating input sets (keeps weights out of L2)")
    ap.add_argument("--layers", type=int, default=32)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemm_probe needs a CUDA GPU (FP8 GEMMs run on Hopper or newer)")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for m in [int(t) for t in a.tokens.split(",")]:
        for name, n, k in SHAPES:
            row = probe_shape(name, n, k, m, a.calls, a.rounds, a.sets)
            rows.append(row)
            best = row.get("w8a16_best")
            log.info("%-8s M=%5d  bf16 %7.1f  fp8_mm %7.1f  fp8_q+mm %7.1f TFLOP/s  x%.2f / x%.2f  err %.4f%s",
                     name, m, row["bf16"]["tflops"], row["fp8_mm"]["tflops"], row["fp8_q+mm"]["tflops"],
                     row["speedup_mm"], row["speedup_q+mm"], row["rel_err_fp8_vs_bf16"],
                     f"  w8a16 x{best['speedup']:.2f} ({best['config']})" if best else "")
    steps = []
    for m in sorted({r["m"] for r in rows}):
        sel = [r for r in rows if r["m"] == m]
        b = a.layers * sum(r["bf16"]["ms"] for r in sel)
        f = a.layers * sum(r["fp8_mm"]["ms"] for r in sel)
        q = a.layers * sum(r["fp8_q+mm"]["ms"] for r in sel)
        w = a.layers * sum(min(r["fp8_mm"]["ms"], r.get("w8a16_best", {}).get("ms", 1e9)) for r in sel)
        steps.append({"m": m, "bf16_ms": b, "fp8_mm_ms": f, "fp8_q+mm_ms": q,
                      "speedup_mm": b / f, "speedup_q+mm": b / q, "best_fp8_ms": w, "speedup_best": b / w})
    log.info("\nwhole %d-layer step (linear layers only)\n%6s %10s %10s %10s %8s %8s %8s", a.layers, "M",
             "bf16 ms", "fp8 ms", "fp8+q ms", "x mm", "x q+mm", "x best")
    for s in steps:
        log.info("%6d %10.3f %10.3f %10.3f %8.2f %8.2f %8.2f", s["m"], s["bf16_ms"], s["fp8_mm_ms"], s["fp8_q+mm_ms"],
                 s["speedup_mm"], s["speedup_q+mm"], s["speedup_best"])
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "calls": a.calls, "rounds": a.rounds}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "shapes": rows, "steps": steps}, f, indent=1)


if __name__ == "__main__":
    main()
