"""bench.service.hops end to end on CPU, tiny: every path measured, the hop table and the goals' figures in its record.
(No figure is checked: two requests say nothing about latency; this keeps the script whole — its paths moved
into bench/service/hop_paths.py once.)"""
from __future__ import annotations

import json

from bench.service import hops


def test_hops_measures_every_path_and_writes_its_record(tmp_path):
    out = tmp_path / "hops.json"
    argv = ["--requests", "2", "--warmup", "1", "--prompt-tokens", "16", "--output-tokens", "3"]  # the least that
    # takes every path: what each path's start costs is the test's time
    assert hops.main([*argv, "--logs", str(tmp_path), "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec["paths"]) >= {"serve-http", "door", "client", "actor"}
    for path in rec["paths"].values():
        assert path["ttft_ms"]["p50"] > 0 and path["tokens_per_chunk"] is not None
    assert {"ttft_p50_overhead_ms", "itl_p99_ratio"} <= set(rec["goals"])
    assert rec["client_split_ms"] and rec["router_call_ms"]


def test_a_path_whose_answers_each_came_in_one_chunk_has_no_inter_token_ratio():
    # CI once saw the door coalesce 3-token answers into one chunk each: summarize raised KeyError 'p99'
    def answer(chunks, **extra):
        return {"ttft": chunks[0], "chunks": chunks, "tokens": 3, **extra}

    streamed = [answer([0.010, 0.012, 0.014]), answer([0.011, 0.013, 0.016])]
    samples = {
        "serve-http": streamed, "client": streamed,
        "door": [answer([0.02]), answer([0.021])],
        "actor": [answer([0.009, 0.011], engine_ttft=0.004, queue=0.001)] * 2,
        "rpc": [{"router": 0.001, "ray": 0.0005}] * 2,
        "once-serve-http": [{"e2e": 0.01, "engine_ttft": 0.004}], "once-door": [{"e2e": 0.02, "engine_ttft": 0.004}],
    }
    rec = hops.summarize(samples)
    assert rec["paths"]["door"]["itl_ms"] == {} and rec["goals"]["itl_p99_ratio"] is None
    assert rec["paths"]["client"]["itl_ms"]["p99"] > 0
    text = hops.table(rec)
    assert "inter-token p99 door / serve-http: n/a" in text and "| door | 20.50 / 20.99 | n/a / n/a |" in text
