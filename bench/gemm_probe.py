"""Is cuBLAS's kernel for a whole 8K-token step the fastest way to run our projections? (issue 19)

    python -m bench.gemm_probe --out $OUT/gemm.json        (about 2-3 minutes on an H200)

The no-reuse trace is GEMM-bound: every prefill step is 8,192 tokens, and the split put 11.0 s of its 14.3 s in
two cuBLAS nvjet kernels, the same as vLLM's. The fusion probe (results/2026-12-01-h200-fusion/) timed today's
gate/up projection (+ SiLU-mul) at 707 TFLOP/s on 2,048 tokens but 676 on 8,192 — a larger GEMM should not be
slower per FLOP, unless cuBLAS's heuristic picks a worse kernel there, or the clocks fell as the probe went on
(it ran the shapes small to large). This probe separates the two: for each Llama-3.1-8B projection
(qkv, o, gate/up, down) at M = 2,048 / 4,096 / 8,192 tokens it times, in interleaved rounds (A-B-...-B-A, so
heat and clocks fall on every variant alike), each way of computing the same product:

- `cublas`: F.linear as the engine calls it today;
- `cublaslt`: the same through torch's cuBLASLt backend (torch.backends.cuda.preferred_blas_library);
- `split2`, `split4`: the M rows in 2 or 4 equal chunks, each chunk's F.linear written into one output.

- `lt0`, `lt1`, ... (`--lt-algos N`, GPU only): the first N candidates cuBLASLt's heuristic offers for the shape,
  called through ctypes (flame_llm/kernels/cublaslt.py; `lt0` is its own first pick), so algorithms the default
  never runs are timed in the same interleaved rounds; a candidate whose output differs from `cublas`'s by 1e-2 or
  more is reported but not counted as the best. RunnerConfig.gemm_lt_min_tokens picks among them in the engine.

Each timing is a sustained run (`--calls` back-to-back calls between two CUDA events over rotating inputs, so
nothing stays in L2), which is how a burst runs them. Reported per shape: TFLOP/s per variant (median over
rounds), its ratio to `cublas`, and the largest relative difference of its output from `cublas`'s (the same
arithmetic in another order: ~1e-3 in bf16). `--device cpu --tokens 64 --calls 2 --rounds 1` runs it on CPU
(a smoke of the code path, no figure)."""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.provenance import write_json
from flame_llm.kernels import cublaslt

log = logging.getLogger(__name__)
HID, INTER, HQ, HKV, D = 4096, 14336, 32, 8, 128
SHAPES = {"qkv": (HID, (HQ + 2 * HKV) * D), "o": (HQ * D, HID), "gate_up": (HID, 2 * INTER), "down": (INTER, HID)}
VARIANTS = ("cublas", "cublaslt", "split2", "split4")
ROTATE = 3


def linear_split(x: torch.Tensor, w: torch.Tensor, parts: int, out: torch.Tensor) -> torch.Tensor:
    """x @ w.T computed in `parts` row chunks written into `out`."""
    for xs, os_ in zip(x.chunk(parts), out.chunk(parts)):
        torch.mm(xs, w.t(), out=os_)
    return out


def run_variant(variant: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if variant.startswith("split"):
        return linear_split(x, w, int(variant[5:]), out)
    return F.linear(x, w)


def set_backend(variant: str, device: str) -> None:
    if device == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt" if variant == "cublaslt" else "cublas")


def timed(variant: str, run, xs: list[torch.Tensor], out: torch.Tensor, calls: int, device: str) -> float:
    """Seconds per call over `calls` back-to-back calls of run(variant, x, out) (CUDA events around them all on a
    GPU)."""
    set_backend(variant, device)
    run(variant, xs[0], out)  # the backend's first call of this shape out of the timing
    if device == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        for i in range(calls):
            run(variant, xs[i % len(xs)], out)
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1000.0 / calls
    t = time.perf_counter()
    for i in range(calls):
        run(variant, xs[i % len(xs)], out)
    return (time.perf_counter() - t) / calls


def probe_shape(name: str, m: int, device: str, dtype: torch.dtype, calls: int, rounds: int,
                lt_algos: int = 0) -> dict:
    k, n = SHAPES[name]
    g = torch.Generator(device="cpu").manual_seed(m * 31 + k)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device, dtype)
    xs = [torch.randn(m, k, generator=g).to(device, dtype) for _ in range(ROTATE)]
    out = torch.empty(m, n, device=device, dtype=dtype)
    lt = cublaslt.LtGemm(n, k) if lt_algos else None
    cands = lt.candidates(m, lt_algos) if lt else []

    def run(v: str, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return lt.matmul(cands[int(v[2:])].algo, x, w, o) if v.startswith("lt") else run_variant(v, x, w, o)

    set_backend("cublas", device)
    ref = F.linear(xs[0], w).float()
    err, failed, variants = {}, {}, []
    for v in [*VARIANTS, *(f"lt{i}" for i in range(len(cands)))]:
        set_backend(v, device)
        try:
            got = run(v, xs[0], torch.empty_like(out)).float()
        except RuntimeError as e:  # a candidate the heuristic offers but that does not run here
            if not v.startswith("lt"):
                raise
            failed[v] = str(e)
            continue
        err[v] = ((got - ref).norm() / ref.norm()).item()
        variants.append(v)
    order = variants + variants[::-1]
    secs: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v in order:
            secs[v].append(timed(v, run, xs, out, calls, device))
    set_backend("cublas", device)
    flops = 2.0 * m * k * n
    med = {v: statistics.median(s) for v, s in secs.items()}
    row = {"shape": name, "m": m, "k": k, "n": n, "flops": flops,
           "tflops": {v: flops / med[v] / 1e12 for v in variants},
           "vs_cublas": {v: med["cublas"] / med[v] for v in variants},
           "rel_err_vs_cublas": err, "seconds": secs}
    if lt:
        ok = [v for v in variants if v.startswith("lt") and err[v] < 1e-2]
        row["lt"] = {"offered": len(cands), "failed": failed, "best": min(ok, key=med.__getitem__) if ok else None,
                     "configs": {f"lt{i}": lt.config(h) for i, h in enumerate(cands)}}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gemm_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON record path")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default="2048,4096,8192", help="M values (tokens per step), comma-separated")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--calls", type=int, default=40, help="back-to-back calls per timing")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each runs every variant twice)")
    p.add_argument("--lt-algos", type=int, default=0, help="also time up to N cuBLASLt heuristic candidates (GPU)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tokens = [int(t) for t in a.tokens.split(",")]
    shapes = a.shapes.split(",")
    bad = [s for s in shapes if s not in SHAPES]
    if bad or any(t < 4 or t % 4 for t in tokens):
        p.error(f"--shapes must be of {', '.join(SHAPES)} (got {bad}); --tokens multiples of 4 (got {tokens})")
    if a.lt_algos < 0 or (a.lt_algos and a.device != "cuda"):
        p.error(f"--lt-algos must be >= 0, and 0 off a CUDA device (got {a.lt_algos} on {a.device})")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    rows = []
    for name in shapes:
        for m in tokens:
            r = probe_shape(name, m, a.device, dtype, a.calls, a.rounds, a.lt_algos)
            best = (r.get("lt") or {}).get("best")
            log.info("%s M=%d: %s%s", name, m, {v: round(r["tflops"][v], 1) for v in VARIANTS},
                     f", fastest of {r['lt']['offered']} cuBLASLt candidates {best} {r['tflops'][best]:.1f}"
                     if best else "")
            rows.append(r)
    res = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "args": vars(a), "rows": rows}
    print(table(rows))
    write_json(a.out, res)
    return 0


def table(rows: list[dict]) -> str:
    """TFLOP/s (x cublas) per fixed variant, and with --lt-algos cuBLASLt's first pick and its fastest candidate
    (name, tile / stages / split-K ids, as cuBLASLt numbers them)."""
    lt = any("lt" in r for r in rows)
    head = [f"{v} TFLOP/s (x cublas)" for v in VARIANTS] + (["lt0", "fastest candidate", "its tile/stages/split-K"]
                                                             if lt else [])
    out = ["| shape | M | " + " | ".join(head) + " | max rel diff |", "|---|---|" + "---|" * (len(head) + 1)]
    for r in rows:
        cells = [f"{r['tflops'][v]:.1f} ({r['vs_cublas'][v]:.3f})" for v in VARIANTS]
        if lt:
            best = (r.get("lt") or {}).get("best")
            c = r["lt"]["configs"][best] if best else {}
            cells += [f"{r['tflops']['lt0']:.1f} ({r['vs_cublas']['lt0']:.3f})" if "lt0" in r["tflops"] else "-",
                      f"{best} {r['tflops'][best]:.1f} ({r['vs_cublas'][best]:.3f})" if best else "-",
                      f"{c.get('tile')}/{c.get('stages')}/{c.get('splitk')}" if best else "-"]
        counted = [*VARIANTS, *([r["lt"]["best"]] if (r.get("lt") or {}).get("best") else [])]
        diff = max(r["rel_err_vs_cublas"][v] for v in counted)  # a candidate past 1e-2 is not counted
        out.append(f"| {r['shape']} | {r['m']} | " + " | ".join(cells) + f" | {diff:.1e} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
