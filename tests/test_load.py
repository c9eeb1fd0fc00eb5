"""Sustained-load mode on CPU: the Poisson stream, the per-window figures recomputed from the raw outcomes,
the saturation verdict and the auto search, the workload options (answer lengths, Zipf documents, the shard
kill's effect), the stall figures, and the whole `flame-llm bench --mode load` path against the service's HTTP
front door and our engine's HTTP servers placed round-robin, on the tiny model."""
import gc
import gzip
import json
import os

import numpy as np
import pytest

from bench import cli
from bench.load.load_report import saturation_line, upgrade
from bench.load.load_stalls import (
    STEP_KEYS,
    TIMELINE_KEYS,
    GcWatch,
    merge,
    parse_metrics,
    shared_pauses,
    vllm_steps,
    window_cache,
    window_stalls,
)
from bench.load.load_workloads import OutputLen, doc_weights, draw_doc, hot_share, kill_effect
from bench.load.loadgen import LOAD_FORMAT, LoadConfig, Outcome, arrivals, percentiles, record, saturation, summarize
from bench.load.mode import AutoSearch, load_records, next_rate, render


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
    assert w["arrival_rps"] == pytest.approx(0.5) and w["saturated"]  # 3 of 5 completed: behind its arrivals


def test_a_window_is_saturated_when_its_backlog_grows_not_when_its_requests_are_long():
    """A short window whose requests each take long (the CPU case: 8 s windows, 1.4 s answers) keeps up: its
    completions over the span fall below 95% of arrivals only because the last answers end after the window.
    A server that finishes one request a second under two arrivals a second falls behind."""
    cfg = LoadConfig(rates=(2.0,), duration_s=8.0)
    long = [Outcome(0.5 * k, 0, 0, ttft_s=0.1, e2e_s=1.4, chunk_s=[0.1, 1.4], output_tokens=2) for k in range(16)]
    w = summarize(long, 2.0, cfg)
    assert w["achieved_rps"] < 0.95 * w["arrival_rps"] and w["served_rps"] == pytest.approx(2.0)
    assert not w["saturated"]
    behind = [Outcome(0.5 * k, 0, 0, ttft_s=0.1, e2e_s=1.0 + k * 0.5, chunk_s=[0.1, 1.0 + k * 0.5], output_tokens=2)
              for k in range(16)]  # done at 1, 2, 3, ... s: one a second
    w = summarize(behind, 2.0, cfg)
    assert w["served_rps"] < 0.95 * w["arrival_rps"] and w["saturated"]


def _window(offered: float, sent: int, completed: int, span: float, slo_pct: float = 100.0) -> dict:
    return {"offered_rps": offered, "arrival_rps": sent / 10.0, "achieved_rps": completed / span,
            "saturated": completed / span < 0.95 * sent / 10.0, "slo_met_pct": slo_pct}


def _series(windows: list[dict]) -> dict:
    return {"system": "flame", "config": {"sat_fraction": 0.95}, "saturation": saturation(windows)}


def test_the_report_says_plainly_when_no_offered_rate_saturated():
    """The H200 record's case: at 8 req/s offered the Poisson draw sent 8.5 req/s and all completed (8.476
    achieved): that is not saturation, and the report must not call 8.476 the saturation throughput."""
    ws = [_window(2.0, 18, 18, 10.01), _window(8.0, 85, 85, 10.03)]
    s = saturation(ws)
    assert not s["saturated"] and s["saturation_rps"] is None and s["knee_offered_rps"] is None
    assert s["max_achieved_rps"] == pytest.approx(85 / 10.03) and s["max_unsaturated_offered_rps"] == 8.0
    line = saturation_line(_series(ws))
    assert line.startswith("**No offered rate saturated flame**") and "above 8.00 req/s" in line
    assert "8.475" in line  # the highest achieved, named as such, not as a saturation figure


def test_the_report_names_the_knee_when_a_rate_saturated():
    ws = [_window(2.0, 20, 20, 10.0), _window(4.0, 40, 40, 10.1), _window(8.0, 80, 60, 12.0),
          _window(16.0, 160, 62, 13.0)]
    s = saturation(ws)
    assert s["saturated"] and s["knee_offered_rps"] == 8.0 and s["max_unsaturated_offered_rps"] == 4.0
    assert s["saturation_rps"] == pytest.approx(5.0)  # the highest achieved of a saturated window (60/12)
    line = saturation_line(_series(ws))
    assert line.startswith("**Saturated at 8.00 req/s offered**") and "kept up with: 4.00" in line
    assert "capacity 5.000 req/s" in line
    every = saturation_line(_series([_window(2.0, 20, 10, 12.0)]))
    assert "fell behind at every offered rate" in every
    # a window that fell behind below a rate that kept up is not the knee (the CPU hot-prefix run's flame-rr)
    odd = [_window(4.0, 40, 30, 10.5), _window(8.0, 80, 80, 10.0)]
    s = saturation(odd)
    assert not s["saturated"] and s["knee_offered_rps"] is None and s["anomalies"] == [4.0]
    line = saturation_line(_series(odd))
    assert line.startswith("**No offered rate saturated flame**") and "Windows at 4.00 req/s fell behind" in line
    s = saturation(odd + [_window(16.0, 160, 90, 12.0)])
    assert s["knee_offered_rps"] == 16.0 and s["max_unsaturated_offered_rps"] == 8.0 and s["anomalies"] == [4.0]


def test_the_capacity_ratio_is_only_given_between_saturated_systems():
    cfg = LoadConfig(rates=(2.0,), duration_s=10.0)
    fast = [Outcome(0.1 * k, 0, 0, ttft_s=0.1, e2e_s=0.2, chunk_s=[0.1, 0.2], output_tokens=2, status=200,
                    max_tokens=2) for k in range(20)]
    slow = fast[:10] + [Outcome(5.0, 0, 0, status=503, error="HTTP 503: overloaded") for _ in range(10)]
    recs = [record(name, cfg, [summarize(o, 2.0, cfg)], [o], {}) for name, o in (("flame", fast), ("vllm", slow))]
    md = render(recs)
    assert "| flame / vllm | n/a: flame did not saturate |" in md
    assert "**Saturated at 2.00 req/s offered**" in md and "**No offered rate saturated flame**" in md


def test_auto_search_doubles_then_bisects_the_knee_within_its_budget():
    cfg = LoadConfig(rates=(1.0,), slo_target_pct=90.0)
    auto = AutoSearch(start_rps=1.0, bisect=2, max_windows=10)
    knee = 5.0  # a system that keeps up below 5 req/s

    def win(r: float) -> dict:
        return {"offered_rps": r, "saturated": r >= knee, "slo_met_pct": 100.0}

    ws, rates = [], []
    while (r := next_rate(ws, auto, cfg)) is not None:
        rates.append(r)
        ws.append(win(r))
    assert rates == [1.0, 2.0, 4.0, 8.0, 6.0, 5.0]  # doubling to the first bad rate, then two bisections
    assert saturation([{**w, "achieved_rps": 1.0} for w in ws])["knee_offered_rps"] == 5.0
    # an SLO miss breaks a window too; the first rate breaking walks down; the window cap holds
    slo = [{"offered_rps": 1.0, "saturated": False, "slo_met_pct": 50.0}]
    assert next_rate(slo, auto, cfg) == 0.5
    assert next_rate([win(1.0)] * 10, auto, cfg) is None
    assert next_rate([win(1.0)], AutoSearch(max_rps=1.5), cfg) is None
    with pytest.raises(ValueError, match="factor"):
        AutoSearch(factor=1.0)


def test_answer_lengths_are_drawn_seeded_within_their_bounds():
    assert OutputLen.parse("16") == OutputLen("fixed", 16, 16)
    for spec in ("uniform:16-1024", "lognormal:16-1024"):
        d = OutputLen.parse(spec)
        assert d.spec() == spec
        xs = [d.draw(np.random.default_rng(3)) for _ in range(3)]
        assert xs == [d.draw(np.random.default_rng(3)) for _ in range(3)]  # seeded
        rng = np.random.default_rng(0)
        many = np.array([d.draw(rng) for _ in range(4000)])
        assert many.min() >= 16 and many.max() <= 1024
    uni = np.array([OutputLen.parse("uniform:16-1024").draw(np.random.default_rng(k)) for k in range(2000)])
    logn = np.array([OutputLen.parse("lognormal:16-1024").draw(np.random.default_rng(k)) for k in range(2000)])
    assert abs(np.median(uni) - 520) < 40 and abs(np.median(logn) - 128) < 15  # sqrt(16 * 1024) = 128
    for bad, msg in (("dist:16-1024", "one of"), ("uniform:9-3", "lo <= hi"), ("lots", "--output-len"),
                     ("uniform:0-4", "lo <= hi")):
        with pytest.raises(ValueError, match=msg):
            OutputLen.parse(bad)
    with pytest.raises(ValueError, match="output_len|--output-len"):
        LoadConfig(output_len="uniform:x-y")


def test_zipf_documents_make_hot_prefixes_and_uniform_draws_as_before():
    w = doc_weights(100, 1.2)
    assert w[0] > 10 * w[20] and w.sum() == pytest.approx(1.0)
    rng = np.random.default_rng(1)
    docs = [draw_doc(rng, w) for _ in range(5000)]
    assert 0.25 < hot_share(docs) < 0.35  # 1 / H(100, 1.2) ~ 0.30
    uni = doc_weights(8, 0.0)
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    assert [draw_doc(a, uni) for _ in range(50)] == [int(b.integers(8)) for _ in range(50)]  # the seed's draws
    with pytest.raises(ValueError, match="doc_zipf"):
        LoadConfig(doc_zipf=-1.0)


def test_the_shard_kill_effect_is_read_from_the_outcomes():
    outs = [Outcome(0.0, 0, 0, ttft_s=0.1, e2e_s=0.5, chunk_s=[0.1, 0.5], output_tokens=2),  # done before the kill
            Outcome(0.8, 0, 0, ttft_s=0.1, e2e_s=2.0, chunk_s=[0.1, 1.9, 2.0], output_tokens=3),  # spans it: 1.8 s gap
            Outcome(0.9, 0, 0, error="shard_died: gone", status=200),  # in flight, failed
            Outcome(1.5, 0, 0, ttft_s=0.2, e2e_s=0.4, chunk_s=[0.2, 0.4], output_tokens=2)]  # after it
    k = kill_effect(outs, {"at_s": 1.0, "shard": 0, "restarted": True, "recovery_s": 3.0})
    assert (k["in_flight"], k["failed"], k["sent_after"], k["failed_after"]) == (2, 1, 1, 0)
    assert k["max_gap_s"] == pytest.approx(1.8) and k["errors"] == ["shard_died: gone"]
    assert k["sent_during_restart"] == 1 and k["ttft_max_during_restart_s"] == pytest.approx(0.2)
    assert kill_effect(outs, {"shard": 0})["fired"] is False
    with pytest.raises(ValueError, match="kill_shard_at_s"):
        LoadConfig(duration_s=10.0, kill_shard_at_s=10.0)


def test_stall_figures_read_around_a_window():
    text = ("# HELP x\nflame_engine_jit_compiles_total{shard=\"0\"} 3.0\nflame_engine_attention_jit_compiles 1\n"
            "flame_engine_gc_pauses_over_10ms_total 2\nflame_engine_gc_pause_max_seconds 0.0123\nother 5\n"
            "flame_shard_long_launches_total{shard=\"0\"} 4\nflame_shard_long_launch_seconds_total 0.08\n"
            "flame_shard_early_commits_total 1\n")
    assert parse_metrics(text) == {"jit_compiles": 3.0, "attention_jit_compiles": 1.0, "gc_pauses_over_10ms": 2.0,
                                   "gc_pause_max_s": 0.0123, "long_launches": 4.0, "long_launch_s": 0.08,
                                   "early_commits": 1.0}
    before = merge([{"jit_compiles": 1, "gc_pauses_over_10ms": 0, "gc_pause_max_s": 0.004, "long_launches": 2,
                     "long_launch_s": 0.03},
                    {"jit_compiles": 2, "gc_pauses_over_10ms": 1, "gc_pause_max_s": 0.02}])
    none = {"attention_jit_compiles": None, "early_commits": None, **dict.fromkeys(STEP_KEYS + TIMELINE_KEYS)}
    assert before == {"jit_compiles": 3, "gc_pauses_over_10ms": 1, "gc_pause_max_s": 0.02, "long_launches": 2,
                      "long_launch_s": 0.03, **none}
    after = {**before, "jit_compiles": 5, "gc_pauses_over_10ms": 2, "gc_pause_max_s": 0.05, "long_launches": 6,
             "long_launch_s": 0.11}
    st = window_stalls(before, after, {"gc_pauses_over_10ms": 0, "gc_pause_max_s": 0.001, "collections": 3})
    assert st["engine"] == {"jit_compiles": 2, "gc_pauses_over_10ms": 1, "gc_pause_max_s": 0.05, "long_launches": 4,
                            "long_launch_s": pytest.approx(0.08), **none}
    assert window_stalls(None, None, {})["engine"]["jit_compiles"] is None  # a system without counters: n/a
    vllm = ('vllm:iteration_tokens_total_bucket{le="1.0",model_name="m"} 3.0\n'
            'vllm:iteration_tokens_total_count{model_name="m"} 40.0\n'
            'vllm:iteration_tokens_total_sum{model_name="m"} 900.0\n'
            'vllm:num_requests_running{model_name="m"} 2.0\n')
    assert vllm_steps(vllm) == {"num_steps": 40.0, "step_tokens": 900.0}
    st = window_stalls(merge([vllm_steps(vllm)]), merge([{"num_steps": 70.0, "step_tokens": 1500.0}]), {})
    assert st["engine"]["num_steps"] == 30.0 and st["engine"]["step_tokens"] == 600.0
    assert window_cache({"prefix_hit_tokens": 10, "prefix_query_tokens": 100, "evictions": 2},
                        {"prefix_hit_tokens": 70, "prefix_query_tokens": 300, "evictions": 5}) == {
        "prefix_hit_tokens": 60, "prefix_query_tokens": 200, "evictions": 3, "hit_rate": 0.3}
    assert window_cache(None, {"prefix_hit_tokens": 1}) is None
    assert window_cache({"prefix_hit_tokens": 9}, {"prefix_hit_tokens": 1}) is None  # restarted: unknown, not < 0
    assert window_stalls({"jit_compiles": 4}, {"jit_compiles": 1}, {})["engine"]["jit_compiles"] is None
    junk = [[{} for _ in range(50)] for _ in range(20000)]
    with GcWatch(threshold_s=0.0) as w:
        gc.collect()
    del junk
    assert w.collections >= 1 and w.num_over >= 1 and w.max_s > 0
    assert w.figures()["gc_pauses_over_10ms"] == w.num_over
    assert w not in gc.callbacks  # removed on exit


def test_a_record_of_the_first_format_is_upgraded_from_its_outcomes():
    cfg = LoadConfig(rates=(2.0,), duration_s=10.0)
    outs = [Outcome(0.5 * k, 0, 0, ttft_s=0.1, e2e_s=0.3, chunk_s=[0.1, 0.3], output_tokens=2, status=200)
            for k in range(20)]
    new = record("flame", cfg, [summarize(outs, 2.0, cfg)], [outs], {})
    old = {**new, "format": "flame-load-raw/1", "windows": [{k: v for k, v in new["windows"][0].items()
                                                            if k not in ("arrival_rps", "saturated")}],
           "saturation_rps": 2.0}
    for o in old["outcomes"][0]:
        del o["max_tokens"]
    old["config"] = {k: v for k, v in old["config"].items() if k not in ("output_len", "doc_zipf", "sat_fraction")}
    up = upgrade(old)
    assert up["format"] == LOAD_FORMAT and up["saturation"] == new["saturation"] and up["saturation_rps"] is None
    assert up["windows"][0]["arrival_rps"] == 2.0 and not up["windows"][0]["saturated"]


@pytest.mark.slow
def test_load_mode_against_the_front_door_and_the_engine_server(tmp_path):
    out = tmp_path / "load"
    argv = ["bench", "--mode", "load", "--systems", "flame,engine-rr", "--model", "tiny", "--load-format", "auto",
            "--rates", "2,6", "--duration-s", "4", "--drain-s", "60", "--docs", "4", "--doc-tokens", "96",
            "--question-tokens", "8", "--output-len", "fixed", "--output-tokens", "4", "--warmup-requests", "2",
            "--max-model-len", "512",
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
            figures = {k: v for k, v in window.items() if k not in ("stalls", "cache")}
            assert figures == json.loads(json.dumps(summarize(outs, window["offered_rps"], cfg)))  # the raw says so
            jit = window["stalls"]["engine"]["attention_jit_compiles"]  # serve-http: n/a until /metrics has it
            cache = window["cache"]  # prompt tokens looked up over the window: every request's, on any engine
            assert cache["prefix_query_tokens"] >= sum(104 for _ in outs) and 0 <= cache["hit_rate"] <= 1
            assert jit == 0 if rec["system"] == "flame" else jit in (None, 0)
            if rec["system"] == "flame":  # where the window's tokens went: its steps, decode-only and mixed
                eng = window["stalls"]["engine"]
                assert eng["num_steps"] >= eng["num_decode_steps"] + eng["num_mixed_steps"] > 0
                assert eng["step_tokens"] == eng["num_decode_tokens"] + eng["num_prefill_tokens"] >= 4 * len(outs)
            assert window["completed"] == len(outs) > 0 and window["failed"] == window["rejected"] == 0
            assert all(o.output_tokens == 4 for o in outs)
    md = open(os.path.join(out, "load-report.md")).read()
    assert md == render(recs) and os.path.getsize(os.path.join(out, "load-report.png")) > 10_000


def test_a_short_auto_search_with_answer_lengths_and_zipf_documents_reports_what_its_records_hold(tmp_path):
    """One serve-http on the tiny model, `--rates auto` over three short windows, answer lengths drawn in 2-12
    tokens and Zipf documents: the rates follow the search rule over the recorded windows, every window's figures
    and the report come from the raw records, every request got the length it asked for, the startup time and
    the stall figures are recorded."""
    out = tmp_path / "auto"
    argv = ["bench", "--mode", "load", "--systems", "engine", "--num-shards", "1", "--model", "tiny",
            "--load-format", "auto", "--rates", "auto", "--auto-start-rps", "4", "--auto-max-windows", "3",
            "--auto-bisect", "1", "--duration-s", "2", "--drain-s", "30", "--docs", "8", "--doc-tokens", "64",
            "--question-tokens", "8", "--output-len", "uniform:2-12", "--doc-zipf", "1.5", "--warmup-requests", "2",
            "--max-model-len", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--engine-json",
            '{"cpu_kvcache_gib": 0.0625}', "--out", str(out)]
    assert cli.main(argv) == 0
    (rec,) = load_records(str(out))
    cfg = LoadConfig(**{k: tuple(v) if k == "rates" else v for k, v in rec["config"].items()})
    auto = AutoSearch(**rec["auto"])
    assert 1 <= len(rec["windows"]) <= 3 and rec["windows"][0]["offered_rps"] == 4.0
    for k, w in enumerate(rec["windows"]):
        assert w["offered_rps"] == next_rate(rec["windows"][:k], auto, cfg)
    assert next_rate(rec["windows"], auto, cfg) is None or len(rec["windows"]) == 3
    assert rec["saturation"] == saturation(rec["windows"])
    docs = []
    for window, raw in zip(rec["windows"], rec["outcomes"]):
        outs = [Outcome(**o) for o in raw]
        w = {k: v for k, v in window.items() if k not in ("stalls", "cache")}
        assert w == json.loads(json.dumps(summarize(outs, window["offered_rps"], cfg)))
        assert window["completed"] == len(outs) > 0 and window["short_answers"] == 0
        assert all(2 <= o.max_tokens <= 12 and o.output_tokens == o.max_tokens for o in outs)
        assert window["stalls"]["client"]["gc_pauses_over_10ms"] >= 0
        docs += [o.doc for o in outs]
    assert len({o["max_tokens"] for raw in rec["outcomes"] for o in raw}) > 3  # drawn, not fixed
    assert np.bincount(docs).argmax() == 0  # Zipf: the first document is the hottest
    assert rec["startup"]["first_answer_s"] >= rec["startup"]["start_s"] > 0
    assert len(rec["provenance"]["source_digest"]) == 16 and rec["provenance"]["machine"]["id"]  # what ran, where
    md = open(os.path.join(out, "load-report.md")).read()
    assert md == render([rec]) and "uniform:2-12" in md and "Zipf s=1.5" in md and "startup:" in md
    assert ("**No offered rate saturated engine**" in md) != rec["saturation"]["saturated"]
    # a gzipped raw record (long answers make MBs of chunk times) is read as the same record
    raw = out / "raw" / "load-engine.json"
    with gzip.open(str(raw) + ".gz", "wt") as f:
        f.write(raw.read_text())
    raw.unlink()
    assert load_records(str(out)) == [rec]


def test_the_report_is_rendered_again_from_raw_records_of_separate_calls(tmp_path):
    from bench.load import load_report

    cfg = LoadConfig(rates=(2.0,), duration_s=10.0)
    outs = [Outcome(0.5 * k, 0, 0, ttft_s=0.1, e2e_s=0.3, chunk_s=[0.1, 0.3], output_tokens=2, status=200,
                    max_tokens=2) for k in range(20)]
    os.makedirs(tmp_path / "raw")
    for name in ("engine", "flame"):  # two calls into one --out: the subject leads, not the file order
        with open(tmp_path / "raw" / f"load-{name}.json", "w") as f:
            json.dump(record(name, cfg, [summarize(outs, 2.0, cfg)], [outs], {}), f)
    assert load_report.main([str(tmp_path)]) == 0
    md = open(tmp_path / "load-report.md").read()
    assert md == render(load_records(str(tmp_path))[::-1]) and md.index("## flame") < md.index("## engine")
    assert "| flame / engine | n/a: flame and engine did not saturate |" in md
    with pytest.raises(SystemExit, match="no load records"):
        load_report.main([str(tmp_path / "nothing")])


def test_pauses_that_several_streams_sat_through_together_are_found():
    """The H200 record's 2 req/s stall in miniature: three streams whose tokens stop and resume at the same instant
    (one engine step held them all), and one stream with a long gap of its own (not shared)."""
    outs = [Outcome(0.0, 0, 0, ttft_s=0.1, e2e_s=2.2, chunk_s=[0.1, 0.2, 2.0, 2.2], output_tokens=4),
            Outcome(0.5, 0, 0, ttft_s=0.2, e2e_s=1.7, chunk_s=[0.2, 1.505, 1.7], output_tokens=3),  # resumes at 2.005
            Outcome(1.0, 0, 0, ttft_s=1.0, e2e_s=1.2, chunk_s=[1.0, 1.2], output_tokens=2),  # first token at 2.0
            Outcome(3.0, 0, 0, ttft_s=0.1, e2e_s=1.0, chunk_s=[0.1, 1.0], output_tokens=2)]  # alone: 0.9 s gap
    (p,) = shared_pauses(outs)
    assert p["streams"] == 3 and p["end_s"] == pytest.approx(2.0)
    assert p["pause_s"] == pytest.approx(1.0) and p["longest_wait_s"] == pytest.approx(1.8)
    assert shared_pauses(outs, min_gap_s=2.0) == []
    md = render([record("flame", LoadConfig(rates=(2.0,), duration_s=4.0), [summarize(outs, 2.0,
                        LoadConfig(rates=(2.0,), duration_s=4.0))], [outs], {})])
    assert "1 wait(s) of >= 0.5 s" in md and "ending 2.00 s, 3 streams waited >= 1.00 s" in md


@pytest.mark.slow
def test_a_shard_killed_mid_window_is_restarted_and_its_effect_recorded(tmp_path):
    """flame on two CPU shards, shard 0's engine actor killed 1 s into a 5 s window: the record says the kill
    fired and Ray restarted the shard (with its recovery time), no request failed (the streams past their first
    token on shard 0 resumed, as the door's counter says), and the report names the kill. (The kill once read
    health() by key after it became a ShardHealth: the kill raised in its thread, was never retrieved, and the
    window was recorded as if the shard had been killed.)"""
    out = tmp_path / "kill"
    argv = ["bench", "--mode", "load", "--systems", "flame", "--model", "tiny", "--load-format", "auto",
            "--rates", "4", "--duration-s", "5", "--drain-s", "60", "--docs", "4", "--doc-tokens", "64",
            "--question-tokens", "8", "--output-len", "fixed", "--output-tokens", "400", "--warmup-requests", "2",
            "--max-model-len", "512",
            "--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--kill-shard-at", "1", "--engine-json",
            '{"cpu_kvcache_gib": 0.0625}', "--out", str(out)]
    assert cli.main(argv) == 0
    (rec,) = load_records(str(out))
    (w,) = rec["windows"]
    k = w["kill"]
    assert k["fired"] and k["shard"] == 0 and k["restarted"] and k["recovery_s"] > 0 and k["at_s"] >= 1.0
    assert k["failed_after"] == 0 and w["completed"] + w["failed"] == w["sent"] > 0
    # nothing lost: streams past their first token resume (the door's counter, read around the window)
    assert k["failed"] == w["failed"] == 0 and 1 <= k["resumed"] <= k["in_flight"]  # 400-token answers: some
    md = open(os.path.join(out, "load-report.md")).read()
    assert "shard 0 killed" in md and "restarted after" in md and "stream(s) resumed" in md


def test_a_failed_window_event_fails_the_window_instead_of_passing_unseen():
    """run_rate's event (the shard kill) raising in its thread: the window raises, naming it."""
    import asyncio

    from bench.http_client import Replica
    from bench.load.loadgen import run_rate

    def boom() -> None:
        raise TypeError("not subscriptable")

    cfg = LoadConfig(duration_s=0.2, drain_s=1.0, num_docs=1, doc_tokens=4, question_tokens=1, output_tokens=1)
    docs = np.zeros((1, 4), dtype=np.int64)
    assert len(arrivals(0.001, cfg.duration_s, cfg.seed * 7919)) == 0  # no request is sent: the event alone
    with pytest.raises(RuntimeError, match="event failed: TypeError"):
        replica = Replica(0, "http://127.0.0.1:9", "cpu-0")
        asyncio.run(run_rate([replica], cfg, 0.001, docs, "rev", event=(0.0, boom, {})))


def test_load_modes_default_answers_are_drawn_lengths_not_one_fixed_length():
    """Issue 39: a fixed 16-token answer hides decode. `flame-llm bench --mode load` with no length option draws
    answers lognormally in 32-512 tokens (median 128), seeded; `--output-len long` is 64-1,024 (median 256) and the
    fixed answer stays available as `--output-len fixed` (--output-tokens each) or N."""
    import argparse

    from bench.burst import pairs
    from bench.load.loadgen import answer_rng
    from bench.load.mode import load_config
    from bench.run_options import resolve_options

    parser = argparse.ArgumentParser()
    pairs.add_arguments(parser)

    def drawn(*flags: str) -> np.ndarray:
        a = parser.parse_args(["--mode", "load", *flags])
        resolve_options(a)  # the machine's defaults, as `flame-llm bench` fills them
        cfg = load_config(a, vocab_size=512)
        lengths, rng = cfg.lengths(), answer_rng(cfg, 0)
        return np.array([lengths.draw(rng) for _ in range(2000)])

    default = drawn()
    assert len(set(default.tolist())) > 50, "load mode's default answers have one fixed length"
    assert default.min() >= 32 and default.max() <= 512 and abs(np.median(default) - 128) < 10
    assert np.array_equal(default, drawn())  # seeded
    long = drawn("--output-len", "long")
    assert long.min() >= 64 and long.max() <= 1024 and abs(np.median(long) - 256) < 20
    assert set(drawn("--output-len", "fixed").tolist()) == {16} and set(drawn("--output-len", "24").tolist()) == {24}
    assert set(drawn("--output-len", "fixed", "--output-tokens", "7").tolist()) == {7}


def test_interactive_goodput_counts_mlperfs_bounds_whatever_the_slo_flags():
    """TTFT <= 0.5 s and TPOT <= 30 ms (MLPerf's interactive bounds) beside the --slo-* goodput (here 2 s / 100 ms,
    which every request meets): a late first token or a slow decode each miss it; the report shows both."""
    cfg = LoadConfig(rates=(1.0,), duration_s=10.0, slo_ttft_s=2.0, slo_tpot_s=0.1)
    outs = [Outcome(0.0, 0, 0, ttft_s=0.4, e2e_s=0.4 + 10 * 0.025, chunk_s=[0.4, 0.65], output_tokens=11),  # meets
            Outcome(1.0, 0, 0, ttft_s=0.6, e2e_s=0.6 + 10 * 0.025, chunk_s=[0.6, 0.85], output_tokens=11),  # TTFT
            Outcome(2.0, 0, 0, ttft_s=0.3, e2e_s=0.3 + 10 * 0.035, chunk_s=[0.3, 0.65], output_tokens=11),  # TPOT
            Outcome(3.0, 0, 0, ttft_s=0.5, e2e_s=0.5, chunk_s=[0.5], output_tokens=1)]  # one token: TTFT only
    w = summarize(outs, 1.0, cfg)
    assert w["goodput_rps"] == pytest.approx(0.4) and w["slo_met_pct"] == 100.0
    assert w["interactive_rps"] == pytest.approx(0.2) and w["interactive_met_pct"] == 50.0
    md = render([record("flame", cfg, [w], [outs], {})])
    assert "TTFT <= 0.5 s and TPOT <= 30 ms" in md and "| 0.200 (50.0) |" in md
    assert f"| {w['output_tok_s']:.1f} |" in md
