"""cuBLASLt through ctypes, on the library torch has loaded: y[M,N] = x[M,K] @ w[N,K].T in bf16 (fp32
accumulation, as F.linear) with any of the algorithms cublasLtMatmulAlgoGetHeuristic offers for the shape, not only
its first. torch's TunableOp tries only cuBLAS's default on CUDA; bench.gemm_probe --lt-algos times these beside it.
Column-major, as cuBLAS sees F.linear's row-major operands: y.T[N,M] = op_T(w.T[K,N]) @ x.T[K,M]."""
from __future__ import annotations

import ctypes

import torch

COMPUTE_32F, R_32F, R_16BF, OP_T = 68, 0, 14, 1  # cublasComputeType_t, cudaDataType_t, cublasOperation_t
DESC_TRANSA, PREF_MAX_WORKSPACE = 3, 1  # cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t
CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6}
WORKSPACE = 32 << 20  # what torch gives cuBLAS(Lt) on Hopper


class Algo(ctypes.Structure):  # cublasLtMatmulAlgo_t
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


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
    lt.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]
    lt.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [vp, ctypes.c_int, vp, sz, ctypes.POINTER(sz)]
    return lt


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} returned cublasStatus_t {status}")


class LtGemm:
    """One (M, N, K) bf16 GEMM and the candidates the heuristic offers for it (up to max_algos; `count` of them)."""

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
        """Candidate i's tile id, stages id, split-K, ... (cuBLASLt's enums), workspace and waves."""
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
                                     vp(torch.cuda.current_stream().cuda_stream)), f"cublasLtMatmul candidate {i}")
        return y
