"""bench.hops end to end on CPU, tiny: every path measured, the hop table and the goals' figures in its record.
(No figure is checked: two requests say nothing about latency; this keeps the script whole — its paths moved
into bench/hop_paths.py once.)"""
from __future__ import annotations

import json

from bench import hops


def test_hops_measures_every_path_and_writes_its_record(tmp_path):
    out = tmp_path / "hops.json"
    assert hops.main(["--requests", "2", "--output-tokens", "3", "--logs", str(tmp_path), "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec["paths"]) >= {"serve-http", "door", "client", "actor"}
    for path in rec["paths"].values():
        assert path["ttft_ms"]["p50"] > 0 and path["tokens_per_chunk"] is not None
    assert {"ttft_p50_overhead_ms", "itl_p99_ratio"} <= set(rec["goals"])
    assert rec["client_split_ms"] and rec["router_call_ms"]
