"""bench/engine/decode_profile.py on CPU, our engine on the tiny model: the grid's points are measured (wall and host
time,
the path every timed step took), a point whose rows do not fit the KV cache is listed as skipped, bad grid flags
are refused; the table's ratios of two systems come from their points."""
import json

import pytest

from bench.engine import decode_profile


def test_the_decode_profile_measures_our_engine_on_cpu(tmp_path):
    out = tmp_path / "p.json"
    # 8 blocks of 128 tokens: 4 rows of 128 + headroom fit, 8 do not
    rc = decode_profile.main(["--systems", "engine", "--model", "tiny", "--batches", "1,4,8", "--contexts", "128",
                              "--mixed", "2x128+32", "--steps", "3", "--warm-steps", "1", "--engine-json",
                              '{"num_kvcache_blocks": 8, "block_size": 128}', "--out", str(out)])
    assert rc == 0
    rec = json.load(open(out))
    (res,) = rec["results"]
    assert res["system"] == "engine" and res["kv_capacity_tokens"] == 1024 and res["cuda_graphs"] is False
    pts = {(p["batch"], p["context"], p["prefill"]): p for p in res["points"]}
    assert set(pts) == {(1, 128, 0), (4, 128, 0), (8, 128, 0), (2, 128, 32)}
    assert "over 95% of the KV cache (1024 tokens)" in pts[(8, 128, 0)]["skipped"]
    for k in ((1, 128, 0), (4, 128, 0), (2, 128, 32)):
        p = pts[k]
        assert not p["skipped"] and p["wall_ms"] > 0 and 0 < p["host_ms"] <= p["wall_ms"]
        assert p["paths"] == {"eager": 3} and p["gpu_ms"] is None  # CPU: no graphs, no kernel times
    md = decode_profile.render(rec["results"])
    assert "| 8 | 128 | 0 | skipped (KV) | - |" in md and "| 2 | 128 | 32 |" in md and "eager 3" in md


def test_two_systems_table_gives_flame_over_vllm_per_point():
    flame = {"system": "engine", "graph_sizes": [1, 2, 4, 8, 16], "points": [
        {"batch": 8, "context": 1024, "prefill": 0, "wall_ms": 9.0, "gpu_ms": 8.0, "idle_ms": 1.0, "host_ms": 2.0,
         "paths": {"decode graph": 24}, "skipped": ""}]}
    vllm = {"system": "vllm", "graph_sizes": [1, 2, 4, 8, 16], "points": [
        {"batch": 8, "context": 1024, "prefill": 0, "wall_ms": 7.5, "gpu_ms": 6.4, "idle_ms": 1.1, "host_ms": None,
         "paths": None, "skipped": ""}]}
    md = decode_profile.render([flame, vllm])
    row = "| 8 | 1024 | 0 | 9.00 / 8.00 / 1.00 | decode graph 24 | 7.50 / 6.40 / 1.10 | graph 8 | 1.200 | 1.250 |"
    assert row in md


def test_bad_grid_flags_are_refused_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--mixed must be BxC\\+P"):
        decode_profile.parse_mixed("32x8192")
    assert decode_profile.parse_mixed("32x8192+2048, 1x4+2") == [(32, 8192, 2048), (1, 4, 2)]
    for flags, msg in ((["--batches", "0,1"], "--batches must list integers >= 1"),
                       (["--contexts", "1k"], "--contexts must be comma-separated integers"),
                       (["--systems", "sglang"], "--systems: engine and/or vllm")):
        with pytest.raises(SystemExit, match=msg):
            decode_profile.main([*flags, "--out", str(tmp_path / "x.json")])


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_decode_steps_replay_graphs_and_have_kernel_times(tmp_path):
    """The tiny model on CUDA: pure decode points take the decode graph, every measured point has its kernel time
    from the profiler and its idle time is the wall minus it."""
    out = tmp_path / "p.json"
    assert decode_profile.main(["--systems", "engine", "--model", "tiny", "--batches", "1,8", "--contexts", "256",
                                "--mixed", "8x256+64", "--steps", "8", "--profile-steps", "4", "--out",
                                str(out)]) == 0
    (res,) = json.load(open(out))["results"]
    assert res["cuda_graphs"] and 8 in res["graph_sizes"]
    for p in res["points"]:
        assert not p["skipped"] and p["gpu_ms"] > 0 and p["idle_ms"] == pytest.approx(p["wall_ms"] - p["gpu_ms"])
        if p["prefill"] == 0:
            assert set(p["paths"]) == {"decode graph"}
