"""bench.engine.launch_cost on CPU with the tiny model: both passes run the scenario's steps and the record says what
each
launch cost on the host and where an eager step's host time went. (CPU figures mean nothing; the GPU run is the
measurement. On CPU nothing is busy, so no launch can be flagged as waiting for the GPU.)"""
from __future__ import annotations

import json

from bench.engine import launch_cost


def test_launch_cost_records_every_launch_and_the_miss(tmp_path):
    out = tmp_path / "launch.json"
    assert launch_cost.main(["--model", "tiny", "--doc-tokens", "600", "--streams", "4", "--burst", "3", "--steps",
                             "24", "--max-num-batched-tokens", "512", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    s = rec["summary"]
    passes = [rec["host_pass"], *rec["stream_passes"]]
    assert [p["early"] for p in passes] == [0, 0, 2048]
    for p in passes:
        steps = p["steps"]
        assert len(steps) >= 24 and all(r["host_ms"] > 0 for r in steps)
        assert set(p["marks"]) == {"question", "burst", "miss"}
        g = p["around_miss_ms"]  # the miss's first chunk (512 tokens) is the stream's longest gap after it arrived
        assert g["long_ms"] > 0 and g["before_ms"] is not None
    eager = [r for r in rec["host_pass"]["steps"] if r["path"] == "eager"]
    assert eager and all(r["parts_ms"]["rest"] >= 0 for r in eager)  # no part counted twice
    assert all(r["parts_ms"]["attention (+ K/V store)"] > 0 and r["parts_ms"]["projections (GEMMs)"] > 0
               for r in eager)
    around = s["steps_around_the_miss"]
    assert [r["step"] for r in around][:3] == [-2, -1, 0]
    assert max(r["tokens"] for r in around if r["step"] >= 0) == 512  # the miss's first chunk fills the budget
    assert s["launches_that_waited_for_the_gpu"] == [] and len(s["stream_gaps_ms"]) >= 24
    assert set(s["gaps_at_the_miss_ms"]) == {"0", "2048"}
    assert rec["async_scheduling"] is False  # CPU: synchronous
