"""Sustained-load mode on CPU: the Poisson stream, the per-window figures recomputed from the raw outcomes,
and the whole `flame-llm bench --mode load` path against the service's HTTP front door and our engine's HTTP
servers placed round-robin, on the tiny model."""
import json
import os

import numpy as np
import pytest

from bench import cli
from bench.load import load_records, render
from bench.loadgen import LoadConfig, Outcome, arrivals, percentiles, summarize


def test_arrivals_are_a_seeded_poisson_stream():
    a = arrivals(20.0, 50.0, seed=3)
    assert np.array_equal(a, arrivals(20.0, 50.0, seed=3)) and (np.diff(a) > 0).all() and a[-1] < 50.0
    assert abs(len(a) - 1000) < 5 * np.sqrt(1000)  # Poisson: mean 1000, sd ~32
    gaps = np.diff(a)
    assert abs(gaps.mean() - 0.05) < 0.005 and abs(gaps.std() / gaps.mean() - 1.0) < 0.15  # exponential: cv 1


def test_window_figures_come_from_the_outcomes():
    cfg = LoadConfig(rates=(2.0,), duration_s=10.0, slo_ttft_s=1.0, slo_tpot_s=0.1)
    outs = [Outcome(0.0, 0, 0, ttft_s=0.5, e2e_s=0.77, chunk_s=[0.5, 0.59, 0.68, 0.77], output_tokens=4, status=200),
            Outcome(1.0, 1, 0, ttft_s=1.5, e2e_s=1.6, chunk_s=[1.5, 1.6], output_tokens=2, status=200),  # TTFT miss
            Outcome(2.0, 2, 0, ttft_s=0.2, e2e_s=2.2, chunk_s=[0.2, 2.2], output_tokens=2, status=200),  # TPOT miss
            Outcome(3.0, 0, 0, status=429, error="HTTP 429: busy"),
            Outcome(4.0, 1, 0, status=500, error="HTTP 500: boom")]
    w = summarize(outs, 2.0, cfg)
    assert (w["sent"], w["completed"], w["rejected"], w["failed"]) == (5, 3, 1, 1)
    assert w["span_s"] == 10.0 and w["achieved_rps"] == pytest.approx(0.3)
    assert w["goodput_rps"] == pytest.approx(0.1) and w["slo_met_pct"] == pytest.approx(20.0)
    assert w["output_tok_s"] == pytest.approx(0.8)
    assert w["ttft_s"] == percentiles([0.5, 1.5, 0.2]) and w["e2e_s"] == percentiles([0.77, 1.6, 2.2])
    assert w["tpot_s"]["p50"] == pytest.approx(0.1) and w["tpot_s"]["n"] == 3
    assert w["itl_s"]["n"] == 5 and w["itl_s"]["p99"] == pytest.approx(np.percentile([.09, .09, .09, .1, 2.0], 99))


@pytest.mark.slow
def test_load_mode_against_the_front_door_and_the_engine_server(tmp_path):
    out = tmp_path / "load"
    argv = ["bench", "--mode", "load", "--systems", "flame,engine-rr", "--model", "tiny", "--load-format", "auto",
            "--rates", "2,6", "--duration-s", "4", "--drain-s", "60", "--docs", "4", "--doc-tokens", "96",
            "--question-tokens", "8", "--output-tokens", "4", "--warmup-requests", "2", "--max-model-len", "512",
            "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--engine-json",
            '{"cpu_kvcache_gib": 0.0625}', "--out", str(out)]
    assert cli.main(argv) == 0
    recs = sorted(load_records(str(out)), key=lambda r: ["flame", "engine-rr"].index(r["system"]))  # --systems order
    assert [r["system"] for r in recs] == ["flame", "engine-rr"]
    assert [r["config"]["policy"] for r in recs] == ["cumulative", "round_robin"]  # "-rr": the affinity A/B
    rr = [o["replica"] for window in recs[1]["outcomes"] for o in window]
    assert rr[:4] == [0, 1, 0, 1]
    for rec in recs:
        cfg = LoadConfig(**{k: tuple(v) if k == "rates" else v for k, v in rec["config"].items()})
        assert [w["offered_rps"] for w in rec["windows"]] == [2.0, 6.0]
        for window, raw in zip(rec["windows"], rec["outcomes"]):
            outs = [Outcome(**o) for o in raw]
            assert window == json.loads(json.dumps(summarize(outs, window["offered_rps"], cfg)))  # the raw says so
            assert window["completed"] == len(outs) > 0 and window["failed"] == window["rejected"] == 0
            assert all(o.output_tokens == 4 for o in outs)
    md = open(os.path.join(out, "load-report.md")).read()
    assert md == render(recs) and os.path.getsize(os.path.join(out, "load-report.png")) > 10_000
