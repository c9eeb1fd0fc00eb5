"""bench.cublaslt_probe's CPU parts: the shapes it takes from a model config, the ctypes struct cuBLASLt fills
(cublasLtMatmulHeuristicResult_t: a 64-byte algo, size_t workspace, status, waves, 4 reserved ints = 96 bytes),
and the per-layer estimate. The GEMMs themselves need a GPU (bench/device_run.sh py -m bench.cublaslt_probe)."""
import pytest

from bench import cublaslt_probe as cp


def test_shapes_follow_the_model_config():
    got = {s.name: (s.n, s.k) for s in cp.model_shapes("configs/models/llama-3.1-8b")}
    assert got == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def test_the_heuristic_result_struct_matches_cublaslt():
    assert cp.ctypes.sizeof(cp.Algo) == 64 and cp.ctypes.sizeof(cp.Heuristic) == 96


def _row(name, m, torch_ms, best_ms):
    best = {"index": 3, "ms": best_ms, "tile": 21, "stages": 7, "splitk": 1} if best_ms else None
    return {"shape": name, "m": m, "n": 1, "k": 1, "torch_ms": torch_ms, "torch_tflops": 700.0,
            "heuristic0_ms": torch_ms, "best": best, "speedup": torch_ms / best_ms if best_ms else None,
            "candidates": 5}


def test_layer_estimate_takes_the_largest_m_and_the_fastest_of_each():
    rows = [_row("qkv", 512, 1.0, 0.5), _row("qkv", 8192, 2.0, 1.9), _row("down", 8192, 3.0, 2.9),
            _row("o", 8192, 1.0, None)]  # no valid candidate: left out of both sides
    est = cp.layer_estimate(rows)
    assert est["m"] == 8192 and est["torch_ms"] == pytest.approx(5.0) and est["best_ms"] == pytest.approx(4.8)
    text = cp.table(rows)
    assert "| qkv | 8192 |" in text and "21 / 7 / 1" in text and "| o | 8192 |" in text


def test_without_a_gpu_it_says_so(tmp_path):
    if cp.torch.cuda.is_available():
        pytest.skip("a GPU is here: the probe would run")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        cp.main(["--out", str(tmp_path / "x.json")])
