"""bench.load.long_gaps on the H200 hot-prefix records (the figures bench/RESULTS.md quotes; a copy in tests/fixtures,
the
run's raw records being on the `results` branch) and on a record
built here: long gaps, their neighbours, the ITL p99, and streams with a single chunk (no gaps)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.load import long_gaps
from bench.provenance import read_json

RAW = Path(__file__).parent / "fixtures/hot-prefixes/raw"  # of bench/results/2026-12-02b-h200-workloads/hot-prefixes


def test_the_hot_prefix_records_give_the_figures_results_quotes():
    got = {}
    for system in ("flame", "vllm"):
        for w in long_gaps.record_gaps(read_json(str(RAW / f"load-{system}.json.gz")), 100.0):
            got[system, w["offered_rps"]] = w
    f8, v8 = got["flame", 8.0], got["vllm", 8.0]
    assert (f8["gaps"], f8["long"], v8["long"]) == (3585, 21, 26)
    assert f8["before_ms_p50"] == pytest.approx(45.1, abs=0.05) and v8["before_ms_p50"] == pytest.approx(30.0, abs=0.05)
    assert f8["long_ms_p50"] == pytest.approx(168.5, abs=0.05) and v8["long_ms_p50"] == pytest.approx(181.2, abs=0.05)
    assert f8["itl_p99_ms"] == pytest.approx(40.7, abs=0.05) and v8["itl_p99_ms"] == pytest.approx(33.1, abs=0.05)


def test_a_built_record(tmp_path, capsys):
    outcomes = [{"chunk_s": [0.0, 0.005, 0.050, 0.250, 0.255]},  # gaps 5, 45, 200, 5
                {"chunk_s": [0.1]}, {"chunk_s": None}]  # one chunk, and a failed request: no gaps
    rec = {"system": "x", "windows": [{"offered_rps": 2.0}], "outcomes": [outcomes]}
    w = long_gaps.record_gaps(rec, 100.0)[0]
    assert (w["gaps"], w["long"], w["before_ms_p50"], w["after_ms_p50"]) == (4, 1, pytest.approx(45.0),
                                                                             pytest.approx(5.0))
    path = tmp_path / "load-x.json"
    path.write_text(json.dumps(rec))
    assert long_gaps.main([str(path)]) == 0
    assert "| x | 2 | 4 |" in capsys.readouterr().out


def test_the_load_report_says_where_the_long_gaps_and_their_neighbours_lie():
    from bench.load.load_report import load_records, render
    text = render(load_records(str(RAW.parent)))
    assert ("- at 8.00 req/s, 21 inter-token gaps over 100 ms (0.59% of 3585); the gap before / the long one / the "
            "gap after, p50: 45.1 / 168.5 / 9.4 ms") in text
    assert "p50: 30.0 / 181.2 / 29.2 ms" in text  # vLLM's, in its own section


def test_the_load_report_gives_the_long_launches_of_a_window():
    from bench.load.load_report import _launches
    rec = {"windows": [{"offered_rps": 8.0, "stalls": {"engine": {"long_launches": 4, "long_launch_s": 0.08,
                                                                  "early_commits": 1}}},
                       {"offered_rps": 2.0, "stalls": {"engine": {"long_launches": 0, "long_launch_s": 0.0}}},
                       {"offered_rps": 4.0, "stalls": None}]}  # vLLM: no counters
    assert _launches(rec) == ["", "- at 8.00 req/s, 4 eager steps of 2,048+ tokens, host launch mean 20.0 ms; 1 "
                                  "steps handed out before them"]
