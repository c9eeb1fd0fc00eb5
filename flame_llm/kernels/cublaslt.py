"""cuBLASLt through ctypes, on the library torch has loaded: y[M,N] = x[M,K] @ w[N,K].T in bf16 (fp32
accumulation, as F.linear) with any of the algorithms cublasLtMatmulAlgoGetHeuristic offers for the shape, not only
its first. Column-major, as cuBLAS sees F.linear's row-major operands: y.T[N,M] = op_T(w.T[K,N]) @ x.T[K,M].

Two users: bench.gemm_probe times every candidate beside torch's cuBLAS, and RunnerConfig.gemm_lt_min_tokens
(`tune_linears`) times them at warmup on the model's own projections, for a few step sizes M, and runs eager steps
of at least that many tokens on the fastest one whose output was bitwise F.linear's at the tuned size (a step
between tuned sizes runs the plan of the size below it; on the H200 every candidate was bitwise F.linear's). The
heuristic's first pick (what torch runs) was 1-3% slower than its fastest candidate for Llama-3.1-8B's qkv and
gate/up at 2K-8K tokens (bench/RESULTS.md, session 10); torch's TunableOp tries only cuBLAS's default on CUDA."""
from __future__ import annotations

import ctypes
import functools
import statistics

import torch
import torch.nn.functional as F

COMPUTE_32F, R_32F, R_16BF, OP_T = 68, 0, 14, 1  # cublasComputeType_t, cudaDataType_t, cublasOperation_t
DESC_TRANSA, PREF_MAX_WORKSPACE = 3, 1  # cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t
CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6}
WORKSPACE = 32 << 20  # what torch gives cuBLAS(Lt) on Hopper
ALIGN = 256  # bytes; the heuristic's default assumption for every operand's address
MIN_GAIN = 0.01  # a candidate replaces F.linear at a step size only if its median time is this much lower
ROTATE = 3  # inputs cycled while timing, so a sustained run does not find its operand in L2
# LtLinear calls: below the smallest step size; x not 2-D, contiguous and aligned; F.linear timed fastest there or
# the algorithm does not run that many rows; on cuBLASLt
OUTCOMES = ("small", "layout", "cublas", "lt")


class Algo(ctypes.Structure):  # cublasLtMatmulAlgo_t
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


@functools.cache
def load() -> ctypes.CDLL:
    """The libcublasLt torch loaded (after one bf16 matmul), so these calls and F.linear share one library."""
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
    lt.cublasLtMatmulAlgoCheck.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp]
    lt.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]
    lt.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [vp, ctypes.c_int, vp, sz, ctypes.POINTER(sz)]
    return lt


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} returned cublasStatus_t {status}")


@functools.cache
def _handle_and_workspace(device_index: int) -> tuple[ctypes.c_void_p, torch.Tensor]:
    handle = ctypes.c_void_p()
    check(load().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle, torch.empty(WORKSPACE, dtype=torch.uint8, device=f"cuda:{device_index}")


class LtGemm:
    """bf16 y[M,N] = x[M,K] @ w[N,K].T for one (N, K) and any M: the heuristic's candidates per M, and a matmul
    with a chosen algorithm (layouts made once per M)."""

    def __init__(self, n: int, k: int, device_index: int | None = None):
        self.lt, self.n, self.k = load(), n, k
        self.handle, self.workspace = _handle_and_workspace(torch.cuda.current_device() if device_index is None
                                                            else device_index)
        self.desc, self.a = ctypes.c_void_p(), self._layout(k, n)
        check(self.lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "MatmulDescCreate")
        trans = ctypes.c_int(OP_T)
        check(self.lt.cublasLtMatmulDescSetAttribute(self.desc, DESC_TRANSA, ctypes.byref(trans), 4), "TRANSA")
        self.layouts: dict[int, tuple[ctypes.c_void_p, ctypes.c_void_p]] = {}  # M -> (x layout, y layout)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _layout(self, rows: int, cols: int) -> ctypes.c_void_p:
        lay = ctypes.c_void_p()
        check(self.lt.cublasLtMatrixLayoutCreate(ctypes.byref(lay), R_16BF, rows, cols, rows), "MatrixLayoutCreate")
        return lay

    def _mk(self, m: int) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        if m not in self.layouts:
            self.layouts[m] = (self._layout(self.k, m), self._layout(self.n, m))
        return self.layouts[m]

    def candidates(self, m: int, max_algos: int) -> list[Heuristic]:
        """What cublasLtMatmulAlgoGetHeuristic offers for M rows (its first is the library's own pick)."""
        b, d = self._mk(m)
        pref, ws = ctypes.c_void_p(), ctypes.c_uint64(WORKSPACE)
        check(self.lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        check(self.lt.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "pref")
        results, count = (Heuristic * max_algos)(), ctypes.c_int()
        check(self.lt.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, b, d, d, pref, max_algos,
                                                     results, ctypes.byref(count)), "MatmulAlgoGetHeuristic")
        self.lt.cublasLtMatmulPreferenceDestroy(pref)
        return list(results[:count.value])

    def supports(self, algo: Algo, m: int) -> bool:
        """cublasLtMatmulAlgoCheck: `algo` (picked at another M) runs M rows within our workspace."""
        b, d = self._mk(m)
        res = Heuristic()
        return (self.lt.cublasLtMatmulAlgoCheck(self.handle, self.desc, self.a, b, d, d, ctypes.byref(algo),
                                                ctypes.byref(res)) == 0 and res.workspace <= WORKSPACE)

    def config(self, h: Heuristic) -> dict:
        """A candidate's tile id, stages id, split-K, ... (cuBLASLt's enums), workspace and waves."""
        out = {}
        for name, attr in CONFIG_ATTRS.items():
            v, written = ctypes.c_uint32(), ctypes.c_size_t()
            ok = self.lt.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(h.algo), attr, ctypes.byref(v), 4,
                                                               ctypes.byref(written)) == 0
            out[name] = v.value if ok else None
        return {**out, "workspace": h.workspace, "waves": round(h.waves, 3)}

    def matmul(self, algo: Algo, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = x @ w.T with `algo`, on the current stream. x [M, K], w [N, K], y [M, N]: contiguous bf16."""
        b, d = self._mk(x.shape[0])
        vp = ctypes.c_void_p
        check(self.lt.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), vp(w.data_ptr()), self.a,
                                     vp(x.data_ptr()), b, ctypes.byref(self.beta), vp(y.data_ptr()), d,
                                     vp(y.data_ptr()), d, ctypes.byref(algo), vp(self.workspace.data_ptr()),
                                     WORKSPACE, vp(torch.cuda.current_stream().cuda_stream)), "cublasLtMatmul")
        return y


class LtLinear:
    """One (N, K) projection's plan: per tuned step size M (ascending), the algorithm timed fastest there, or None
    where F.linear was. A step of m rows uses the largest tuned M <= m, if the algorithm runs m rows
    (cublasLtMatmulAlgoCheck, once per m) and x is contiguous and aligned; else __call__ returns None (F.linear)."""

    def __init__(self, gemm: LtGemm, picks: dict[int, Algo | None], records: list[dict] | None = None):
        self.gemm, self.ms = gemm, sorted(picks)
        self.picks, self.records = picks, records or []  # records: what tune_linears measured per step size
        self.by_m: dict[int, Algo | None] = {}
        self.outcomes = dict.fromkeys(OUTCOMES, 0)  # what became of each call (bench.flag_ab prints the sums)

    def algo_for(self, m: int) -> Algo | None:
        if m not in self.by_m:
            tuned = [t for t in self.ms if t <= m]
            algo = self.picks[tuned[-1]] if tuned else None
            self.by_m[m] = algo if algo is not None and self.gemm.supports(algo, m) else None
        return self.by_m[m]

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        if x.shape[0] < self.ms[0]:
            self.outcomes["small"] += 1
            return None
        if x.dim() != 2 or not x.is_contiguous() or x.data_ptr() % ALIGN:
            self.outcomes["layout"] += 1
            return None
        algo = self.algo_for(x.shape[0])
        if algo is None:
            self.outcomes["cublas"] += 1
            return None
        self.outcomes["lt"] += 1
        return self.gemm.matmul(algo, x, w, x.new_empty((x.shape[0], self.gemm.n)))


def tune_ms(min_tokens: int, max_tokens: int) -> list[int]:
    """The step sizes timed at warmup: min_tokens doubled up to max_tokens, and max_tokens itself."""
    assert 0 < min_tokens, min_tokens
    ms, m = [], min_tokens
    while m < max_tokens:
        ms.append(m)
        m *= 2
    return ms + [max_tokens] if min_tokens <= max_tokens else []


def _time(run, xs: list[torch.Tensor], calls: int) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for i in range(calls):
        run(xs[i % len(xs)])
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / calls


def pick(gemm: LtGemm, w: torch.Tensor, m: int, max_algos: int = 16, rounds: int = 2) -> tuple[Algo | None, dict]:
    """Times F.linear and every heuristic candidate whose output is bitwise F.linear's, for x of m rows, in
    interleaved rounds (A-B-..-B-A, each timing a sustained run of back-to-back calls); returns the fastest
    candidate if it beats F.linear by MIN_GAIN, and what was measured (ms medians)."""
    calls = max(10, 80_000 // m)
    g = torch.Generator(device=w.device).manual_seed(m)
    xs = [torch.randn(m, gemm.k, generator=g, device=w.device).to(w.dtype) for _ in range(ROTATE)]
    ref, y = F.linear(xs[0], w), torch.empty(m, gemm.n, dtype=w.dtype, device=w.device)
    runs = {"cublas": lambda x: F.linear(x, w)}
    cands = gemm.candidates(m, max_algos)
    for i, h in enumerate(cands):
        try:
            same = torch.equal(gemm.matmul(h.algo, xs[0], w, y), ref)
        except RuntimeError:  # offered, but does not run here
            same = False
        if same:
            runs[f"lt{i}"] = functools.partial(lambda x, a: gemm.matmul(a, x, w, y), a=h.algo)
    ms: dict[str, list[float]] = {name: [] for name in runs}
    order = [*runs, *reversed(runs)]
    for _ in range(rounds):
        for name in order:
            ms[name].append(_time(runs[name], xs, calls))
    med = {name: statistics.median(v) for name, v in ms.items()}
    best = min((n for n in med if n != "cublas"), key=med.__getitem__, default=None)
    won = best is not None and med[best] <= med["cublas"] * (1 - MIN_GAIN)
    info = {"m": m, "offered": len(cands), "bitwise": len(runs) - 1, "cublas_ms": round(med["cublas"], 4),
            "best": best, "best_ms": round(med[best], 4) if best else None, "used": best if won else "cublas"}
    return (cands[int(best[2:])].algo if won else None), info


def tune_linears(linears: dict[tuple[int, int], torch.Tensor], ms: list[int]) -> tuple[dict, list[dict]]:
    """For each (N, K) -> a weight of that shape: an LtLinear over the step sizes `ms`. Returns the plans and one
    record per (shape, M) for the log."""
    plans, records = {}, []
    for (n, k), w in linears.items():
        gemm = LtGemm(n, k, w.device.index)
        picks, mine = {}, []
        for m in ms:
            picks[m], info = pick(gemm, w, m)
            mine.append({"n": n, "k": k, **info})
        plans[(n, k)] = LtLinear(gemm, picks, mine)
        records += mine
    torch.cuda.empty_cache()
    return plans, records
