"""`flame-llm bench --mode loadgen` (bench/load/mlperf.py): the dataset's lengths, the QPS search, LoadGen's summary
parsed, short Offline and Server runs of the real LoadGen against the real service (tiny model, CPU), error paths."""

import json
import os

import numpy as np
import pytest

from bench import cli
from bench.load.mlperf import LoadgenConfig, QpsSearch, highest_valid, next_qps
from bench.load.mlperf_data import LATENCY_BOUNDS_S, REFERENCE_SAMPLES, DatasetConfig, LengthDist, make_dataset
from bench.load.mlperf_report import parse_summary
from bench.load.mlperf_sut import parse_sut

pytest.importorskip("mlperf_loadgen")  # the 'test' extra installs it


def test_the_dataset_has_the_reference_size_and_llama31_8b_like_lengths_seeded():
    d = make_dataset(DatasetConfig(vocab_size=1000))
    s = d.stats()
    assert s["samples"] == len(d) == REFERENCE_SAMPLES == 13_368
    ins, outs = s["input_tokens"], s["output_tokens"]
    assert 700 <= ins["p50"] <= 860 and ins["max"] <= 2048 and ins["min"] >= 64  # prompts tokenized to <= 2,048
    assert 125 <= outs["mean"] <= 145 and outs["max"] <= 512  # ~611 characters of summary a sample
    assert all(x.dtype == np.int32 and 0 <= x.min() and x.max() < 1000 for x in d.input_ids[:100])
    again = make_dataset(DatasetConfig(vocab_size=1000))
    assert np.array_equal(again.output_lens, d.output_lens) and np.array_equal(again.input_ids[7], d.input_ids[7])
    other = make_dataset(DatasetConfig(vocab_size=1000, seed=1))
    assert not np.array_equal(other.output_lens, d.output_lens)


def test_len_scale_keeps_the_shape_with_less_work_and_bounds_the_longest_sample():
    full = make_dataset(DatasetConfig(samples=2000, vocab_size=512))
    small = make_dataset(DatasetConfig(samples=2000, vocab_size=512, len_scale=0.1))
    ratio = small.stats()["input_tokens"]["mean"] / full.stats()["input_tokens"]["mean"]
    assert 0.09 <= ratio <= 0.11
    assert DatasetConfig(len_scale=0.1).max_total_tokens() == 205 + 51
    assert max(len(x) for x in small.input_ids) + small.output_lens.max() <= 256
    assert LengthDist(10, 0.0, 1, 100).draw(np.random.default_rng(0), 3).tolist() == [10, 10, 10]


def test_the_latency_bounds_are_mlperfs_for_llama31_8b():
    assert LATENCY_BOUNDS_S == {"server": (2.0, 0.1), "interactive": (0.5, 0.03)}


def _search(threshold: float, s: QpsSearch) -> list[tuple[float, bool]]:
    trials = []
    while (q := next_qps(trials, s)) is not None:
        trials.append((q, q <= threshold))
    return trials


def test_find_qps_doubles_until_invalid_then_bisects_to_the_tolerance():
    s = QpsSearch(start=1.0, rel_tol=0.05, max_trials=20)
    trials = _search(7.3, s)
    assert [q for q, _ in trials[:4]] == [1.0, 2.0, 4.0, 8.0]  # doubling up to the first invalid run
    best = highest_valid(trials)
    assert 7.3 * 0.95 <= best <= 7.3
    lo, hi = best, min(q for q, v in trials if not v)
    assert (hi - lo) / hi <= 0.05


def test_find_qps_halves_down_when_the_start_is_invalid_and_stops_at_its_bounds():
    trials = _search(0.3, QpsSearch(start=4.0, max_trials=20))
    assert [q for q, _ in trials[:5]] == [4.0, 2.0, 1.0, 0.5, 0.25]
    assert 0.28 <= highest_valid(trials) <= 0.3
    assert highest_valid(_search(0.0, QpsSearch(start=1.0, min_qps=0.1))) is None  # never valid: gives up at min
    assert len(_search(1e9, QpsSearch(start=1.0, max_trials=4))) == 4  # never invalid: stops at max_trials
    # an invalid run below a valid one (noise): the highest valid stands, the search ends
    assert next_qps([(4.0, True), (2.0, False)], QpsSearch(start=4.0)) is None


def test_a_summary_without_a_result_is_refused_naming_what_is_missing():
    with pytest.raises(AssertionError, match="no 'Result is' line"):
        parse_summary("MLPerf Results Summary\nScenario : Server\n")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--scenario", "offline,burst"], "--scenario must be a comma-separated subset of offline, server"),
        (["--scenario", "server", "--server-qps", "0"], "--server-qps must be > 0"),
        (["--scenario", "server", "--server-qps", "-2"], "--server-qps must be > 0"),
        (["--find-qps-max-s", "0"], "--find-qps-max-s must be > 0"),
        (["--mlperf-len-scale", "1.5"], "'len_scale' (--mlperf-len-scale) must be in (0, 1]"),
        (["--mlperf-samples", "0"], "'samples' (--mlperf-samples) must be an int >= 1"),
        (["--systems", "engine-http"], "'-http' is for flame labels"),
        (["--systems", "sglang"], "system must be one of"),
        (["--mlperf-len-scale", "1"], "--max-model-len 2048 cannot hold the longest sample (2560 tokens"),
    ],
)
def test_bad_options_fail_before_anything_starts_with_a_clear_message(tmp_path, args, message):
    base = ["bench", "--mode", "loadgen", "--systems", "flame", "--model", "tiny", "--mlperf-len-scale", "0.1"]
    with pytest.raises(SystemExit) as e:
        cli.main(base + ["--out", str(tmp_path / "x"), *args])
    assert message in str(e.value)
    assert not os.path.exists(tmp_path / "x")


def test_sut_labels_name_the_transport():
    assert parse_sut("flame")[1] == "python" and parse_sut("flame-http")[1] == "http"
    assert parse_sut("engine")[1] == parse_sut("vllm")[1] == "http"
    assert parse_sut("flame-http")[0].label == "flame-http" and parse_sut("flame-http")[0].kind == "flame"
    with pytest.raises(ValueError, match="server-qps"):
        LoadgenConfig(server_qps=-1.0)


CPU_RUN = [
    "--model",
    "tiny",
    "--load-format",
    "auto",
    "--mlperf-samples",
    "48",
    "--mlperf-len-scale",
    "0.1",
    "--max-num-seqs",
    "32",
    "--engine-json",
    '{"cpu_kvcache_gib": 0.0625}',
]


def _record(out, label: str) -> dict:
    with open(os.path.join(out, "raw", f"loadgen-{label}.json")) as f:
        return json.load(f)


def test_offline_and_server_runs_of_real_loadgen_against_flame_and_the_engine_server(tmp_path):
    """LoadGen issues to the service's Python client and to serve-http over HTTP; its summary lands in our report."""
    out = tmp_path / "lg"
    argv = [
        "bench",
        "--mode",
        "loadgen",
        "--systems",
        "flame,engine",
        "--scenario",
        "offline,server",
        "--server-qps",
        "8",
        "--mlperf-duration-s",
        "2",
        "--mlperf-min-queries",
        "16",
        *CPU_RUN,
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    data = make_dataset(DatasetConfig(samples=48, len_scale=0.1, vocab_size=512, seed=0))
    for label in ("flame", "engine"):
        rec = _record(out, label)
        assert rec["transport"] == ("python" if label == "flame" else "http")
        offline, server = rec["runs"]
        assert offline["scenario"] == "Offline" and offline["result"] == "VALID" and offline["valid"]
        assert offline["counters"]["completed"] == offline["counters"]["issued"] == 48
        assert offline["counters"]["output_tokens"] == int(data.output_lens.sum())  # every answer to its length
        assert offline["tokens_per_s"] > 0 and offline["samples_per_s"] > 0
        assert server["scenario"] == "Server" and server["result"] in ("VALID", "INVALID")
        assert server["target_qps"] == 8.0 and server["counters"]["failed"] == 0
        assert server["counters"]["completed"] >= 16
        assert 0 < server["ttft_p99_s"] < 60 and 0 < server["tpot_p99_s"] < 10  # FirstTokenComplete and token counts
        for run in rec["runs"]:
            for name in ("mlperf_log_summary.txt", "mlperf_log_detail.txt"):
                assert os.path.getsize(os.path.join(run["logs"], name)) > 0  # LoadGen's own files kept
            with open(os.path.join(run["logs"], "mlperf_log_summary.txt")) as f:
                assert parse_summary(f.read())["result"] == run["result"]
    md = open(out / "loadgen.md").read()
    assert "MLPerf-style, not an MLPerf submission" in md
    assert "| flame | offline |" in md and "| engine | server |" in md
    summary = json.load(open(out / "loadgen.json"))["summary"]
    assert summary["flame"]["offline_tokens_per_s"] > 0 and summary["engine"]["offline_tokens_per_s"] > 0


def test_find_qps_over_the_front_door_searches_within_its_budget(tmp_path):
    out = tmp_path / "fq"
    argv = [
        "bench",
        "--mode",
        "loadgen",
        "--systems",
        "flame-http",
        "--scenario",
        "interactive",
        "--find-qps",
        "--server-qps",
        "16",
        "--find-qps-max-s",
        "4",
        "--mlperf-duration-s",
        "1",
        "--mlperf-min-queries",
        "8",
        *CPU_RUN,
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    rec = _record(out, "flame-http")
    fq = rec["find_qps"]["interactive"]
    assert fq["start_qps"] == 16.0 and fq["trials"][0][0] == 16.0 and len(fq["trials"]) >= 2
    assert fq["spent_s"] < 4 + 60  # stops before a run that would overrun the budget (plus one run's drain)
    runs = rec["runs"]
    assert [r["target_qps"] for r in runs] == [q for q, _ in fq["trials"]]
    assert [r["valid"] for r in runs] == [v for _, v in fq["trials"]]
    assert fq["highest_valid_qps"] == highest_valid([tuple(t) for t in fq["trials"]])
    assert all(r["scenario"] == "Server" and r["counters"]["failed"] == 0 for r in runs)
    with open(os.path.join(runs[0]["logs"], "mlperf_log_detail.txt")) as f:
        assert '"requested_server_ttft_latency", "value": 500000000,' in f.read()  # Interactive's bound ran


def test_the_device_stage_runs_loadgen_and_brings_back_its_logs(tmp_path):
    """bench/device_run.sh's `mlperf` stage, on CPU as on the GPU machine: loadgen.md and every LoadGen log in $OUT."""
    import subprocess
    import tarfile

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "MLPERF_DIR": str(tmp_path / "mlperf"), "CACHES_IN": str(tmp_path / "no")}
    args = ["--systems", "engine", "--scenario", "offline", *CPU_RUN]
    p = subprocess.run(
        ["bash", "bench/device_run.sh", "mlperf", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "not an MLPerf submission" in (out / "loadgen.md").read_text()
    with tarfile.open(out / "mlperf.tgz") as t:
        names = t.getnames()
    assert "mlperf/loadgen.json" in names and "mlperf/raw/loadgen-engine.json" in names
    assert "mlperf/loadgen/engine/offline/mlperf_log_summary.txt" in names
    assert "mlperf/loadgen/engine/offline/mlperf_log_detail.txt" in names
