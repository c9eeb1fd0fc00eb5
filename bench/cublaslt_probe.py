"""cuBLASLt's other algorithms for the engine's GEMMs, against the one torch runs today, on one GPU.

    python -m bench.cublaslt_probe --out $OUT/cublaslt.json      (about a minute on an H200)

The no-reuse trace is GEMM-bound: 10.5 s of its 13.8 s are two cuBLAS kernels at ~700 TFLOP/s, the same ones
vLLM runs, picked by cuBLAS's heuristic (bench/RESULTS.md, session 8's split). torch's TunableOp tries only that
default on CUDA, so this asks cuBLASLt itself (through ctypes, on the library torch has loaded) for up to
--algos candidates per shape, times each on rotating inputs, and checks its output against F.linear. Shapes: the
model's (configs/models/*) q/k/v, o, gate/up and down projections at the given token counts, y = x @ W.T in bf16
with fp32 accumulation, as F.linear does. The table: torch's ms, the heuristic's first pick, the fastest
candidate, its speedup over torch and its config (tile, stages, split-K); the last line, a layer's four GEMMs at
the largest token count with the fastest of each against torch's."""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("bench.cublaslt_probe")

COMPUTE_32F, R_32F, R_16BF, OP_N, OP_T = 68, 0, 14, 0, 1  # cublasComputeType_t, cudaDataType_t, cublasOperation_t
DESC_TRANSA, PREF_MAX_WORKSPACE = 3, 1  # cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t
CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6}
WORKSPACE = 32 << 20  # what torch gives cuBLAS(Lt) on Hopper
ROTATE = 4  # input sets cycled through, so none stays in L2 between calls


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt torch loaded (after one bf16 matmul), so the probe and F.linear share one library."""
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcublasLt.so" in line}
    if not paths:
        raise RuntimeError("torch's process has no libcublasLt loaded after a bf16 matmul")
    lt = ctypes.CDLL(sorted(paths)[0])
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lt.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                              ctypes.c_int64]
    lt.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
    lt.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
    lt.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int, vp,
                                                  ctypes.POINTER(ctypes.c_int)]
    lt.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]
    lt.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [vp, ctypes.c_int, vp, sz, ctypes.POINTER(sz)]
    return lt


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} returned cublasStatus_t {status}")


@dataclass(slots=True)
class Shape:
    name: str
    n: int  # output features
    k: int  # input features


def model_shapes(config_dir: str) -> list[Shape]:
    with open(os.path.join(config_dir, "config.json")) as f:
        c = json.load(f)
    hid, inter = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or hid // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c.get("num_key_value_heads", c["num_attention_heads"]) * d
    return [Shape("qkv", q + 2 * kv, hid), Shape("o", hid, q), Shape("gate_up", 2 * inter, hid),
            Shape("down", hid, inter)]


class LtGemm:
    """y[M,N] = x[M,K] @ w[N,K].T (row-major bf16) as cuBLASLt's column-major y.T = op_T(w.T) @ x.T, the layout
    torch's F.linear hands cuBLAS; candidates from cublasLtMatmulAlgoGetHeuristic."""

    def __init__(self, lt: ctypes.CDLL, m: int, n: int, k: int, max_algos: int):
        self.lt, vp = lt, ctypes.c_void_p
        self.handle, self.desc, self.pref = vp(), vp(), vp()
        check(lt.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        check(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "cublasLtMatmulDescCreate")
        trans = ctypes.c_int(OP_T)
        check(lt.cublasLtMatmulDescSetAttribute(self.desc, DESC_TRANSA, ctypes.byref(trans), 4), "TRANSA")
        self.a, self.b, self.d = vp(), vp(), vp()
        for lay, rows, cols in ((self.a, k, n), (self.b, k, m), (self.d, n, m)):
            check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(lay), R_16BF, rows, cols, rows), "layout")
        check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "cublasLtMatmulPreferenceCreate")
        ws = ctypes.c_uint64(WORKSPACE)
        check(lt.cublasLtMatmulPreferenceSetAttribute(self.pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "pref")
        self.results, count = (Heuristic * max_algos)(), ctypes.c_int()
        check(lt.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.d, self.d, self.pref,
                                                max_algos, self.results, ctypes.byref(count)), "GetHeuristic")
        self.count = count.value
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def config(self, i: int) -> dict:
        out = {}
        for name, attr in CONFIG_ATTRS.items():
            v, written = ctypes.c_uint32(), ctypes.c_size_t()
            ok = self.lt.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(self.results[i].algo), attr,
                                                               ctypes.byref(v), 4, ctypes.byref(written)) == 0
            out[name] = v.value if ok else None
        return {**out, "workspace": self.results[i].workspace, "waves": round(self.results[i].waves, 3)}

    def __call__(self, i: int, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        vp = ctypes.c_void_p
        check(self.lt.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), vp(w.data_ptr()), self.a,
                                     vp(x.data_ptr()), self.b, ctypes.byref(self.beta), vp(y.data_ptr()), self.d,
                                     vp(y.data_ptr()), self.d, ctypes.byref(self.results[i].algo),
                                     vp(self.workspace.data_ptr()), WORKSPACE,
                                     vp(torch.cuda.current_stream().cuda_stream)), f"cublasLtMatmul algo {i}")
        return y


def time_ms(fn, inputs: list[tuple], reps: int = 10, rounds: int = 7) -> float:
    """Median over rounds of the mean per call of `reps` back-to-back calls (the host's ctypes cost overlaps)."""
    for args in inputs:
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for r in range(reps):
            fn(*inputs[r % len(inputs)])
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / reps)
    return sorted(times)[len(times) // 2]


def probe_shape(lt: ctypes.CDLL, shape: Shape, m: int, max_algos: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(m * 7 + shape.n)
    w = torch.randn(shape.n, shape.k, device="cuda", dtype=torch.bfloat16, generator=g) * shape.k ** -0.5
    xs = [torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(ROTATE)]
    ys = [torch.empty(m, shape.n, device="cuda", dtype=torch.bfloat16) for _ in range(ROTATE)]
    ref = F.linear(xs[0], w).float()
    flops = 2.0 * m * shape.n * shape.k
    torch_ms = time_ms(lambda x: F.linear(x, w), [(x,) for x in xs])
    gemm = LtGemm(lt, m, shape.n, shape.k, max_algos)
    algos = []
    for i in range(gemm.count):
        try:
            out = gemm(i, xs[0], w, ys[0]).float()
            err = ((out - ref).norm() / ref.norm()).item()
            ms = time_ms(lambda x, y, i=i: gemm(i, x, w, y), list(zip(xs, ys, strict=True)))
        except RuntimeError as e:  # a candidate the library offers but cannot run here
            algos.append({"index": i, "error": str(e)})
            continue
        algos.append({"index": i, "ms": ms, "rel_err": err, "tflops": flops / ms / 1e9, **gemm.config(i)})
    ok = [a for a in algos if "ms" in a and a["rel_err"] < 1e-2]
    best = min(ok, key=lambda a: a["ms"]) if ok else None
    first = next((a for a in algos if a["index"] == 0 and "ms" in a), None)
    return {"shape": shape.name, "m": m, "n": shape.n, "k": shape.k, "torch_ms": torch_ms,
            "torch_tflops": flops / torch_ms / 1e9, "heuristic0_ms": first["ms"] if first else None,
            "best": best, "speedup": torch_ms / best["ms"] if best else None, "candidates": len(algos),
            "algos": algos}


def table(rows: list[dict]) -> str:
    out = ["| shape | M | N x K | torch ms (TFLOP/s) | heuristic #0 ms | best ms | speedup | best's tile / stages / "
           "split-K | candidates |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["best"] or {}
        h0 = f"{r['heuristic0_ms']:.4f}" if r["heuristic0_ms"] else "-"
        cfg = f"{b.get('tile')} / {b.get('stages')} / {b.get('splitk')}" if b else "-"
        out.append(f"| {r['shape']} | {r['m']} | {r['n']} x {r['k']} | {r['torch_ms']:.4f} ({r['torch_tflops']:.0f}) "
                   f"| {h0} | {b.get('ms', float('nan')):.4f} | {r['speedup'] or float('nan'):.3f} | {cfg} "
                   f"| {r['candidates']} |")
    return "\n".join(out)


def layer_estimate(rows: list[dict]) -> dict:
    """A layer's four GEMMs at the largest M: torch's seconds against the fastest candidate of each."""
    m = max(r["m"] for r in rows)
    at = [r for r in rows if r["m"] == m and r["best"]]
    today, best = sum(r["torch_ms"] for r in at), sum(r["best"]["ms"] for r in at)
    return {"m": m, "torch_ms": today, "best_ms": best, "speedup": today / best if best else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cublaslt_probe", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="configs/models/llama-3.1-8b", help="a model dir with config.json")
    p.add_argument("--tokens", default="512,2048,8192", help="token counts (M), comma-separated")
    p.add_argument("--algos", type=int, default=32, help="candidates asked of the heuristic per shape")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tokens = [int(t) for t in a.tokens.split(",")]
    shapes = model_shapes(a.model)
    if not torch.cuda.is_available():
        raise SystemExit("bench.cublaslt_probe needs a CUDA GPU")
    lt = load_cublaslt()
    rows = []
    for m in tokens:
        for s in shapes:
            rows.append(probe_shape(lt, s, m, a.algos))
            r = rows[-1]
            log.info("%s M=%d: torch %.4f ms, best %s, %d candidates", s.name, m, r["torch_ms"],
                     f"{r['best']['ms']:.4f} ms (#{r['best']['index']})" if r["best"] else "-", r["candidates"])
    est = layer_estimate(rows)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": a.model,
                   "workspace": WORKSPACE, "rows": rows, "layer": est}, f, indent=1)
    print(table(rows))
    print(f"\na layer's four GEMMs at M={est['m']}: torch {est['torch_ms']:.4f} ms, fastest candidates "
          f"{est['best_ms']:.4f} ms, speedup {est['speedup']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
