"""A paired report merged from several device calls on several machines (issue 20): synthetic raw records of two
"machines" (the report's arithmetic and its machine table, in a unit test), the systems the issue names, and one
trace's pairs through `ray job submit` against a local `ray start --head`. (The real short CPU run split over two
`bench.burst.pairs` invocations into one --out with --pair-start continues test_bench_smoke's run: one run fewer.)"""
import argparse
import json
import os
import shutil
import subprocess
import tempfile

import pytest

from bench import http_system, provenance, system_config
from bench.burst import jobpairs, pairs, report, runner
from bench.burst.runner import RAW_FORMAT
from bench.burst.traces import TraceConfig, make_trace
from bench.system_config import parse_system

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALE = ["--model", "tiny", "--load-format", "auto", "--docs", "2", "--questions", "2", "--doc-tokens", "128",
         "--question-tokens", "8", "--output-tokens", "4", "--max-model-len", "512", "--max-num-batched-tokens",
         "512", "--max-num-seqs", "8", "--engine-json", '{"cpu_kvcache_gib": 0.03125}', "--warmup-rounds", "1"]
TRACE = make_trace(TraceConfig(name="reuse", num_docs=2, questions=5, doc_tokens=40, question_tokens=5,
                               vocab_size=97)).describe()


def _machine(gpu: str, host: str) -> dict:
    return {"id": gpu, "host": host, "host_id": host + "-id", "gpu_name": "NVIDIA H200",
            "gpus": [{"index": 0, "uuid": gpu, "name": "NVIDIA H200"}]}


def _call(cid: str, via: str = "direct", commit: str = "abc1234", digest: str = "d" * 16) -> dict:
    return {"id": cid, "via": via, "submission_id": None, "commit": commit, "source_digest": digest}


def _raw(label: str, pair: int, position: int, req_s: float, machine: dict | None, call: dict | None,
         ok: bool = True) -> dict:
    """A raw record of 10 requests finishing at once at 10 / req_s s, half of each 100-token prompt cached."""
    reqs = [{"id": f"r{k}", "done_s": 10 / req_s, "prompt_tokens": 100, "cached_tokens": 50, "timings": {}}
            for k in range(10)]
    rec = {"format": RAW_FORMAT, "label": label, "system": label, "vllm_config": None, "policy": "cumulative",
           "trace": TRACE, "warmup_shifts": [7], "pair": pair, "position": position, "host": "legacy-host",
           "placement": ["GPU-legacy"], "engine_config": {}, "error": None, "requests": reqs,
           "started_at": f"2026-12-02T00:00:{pair:02d}.{position}",
           "checks": {"ok": ok, "failures": {} if ok else {"missing": 1}}}
    if machine is not None:
        rec["machine"], rec["call"] = machine, call
    return rec


def _write(root, sub: str, rec: dict) -> None:
    d = os.path.join(root, sub, "raw", rec["trace"]["name"], rec["label"])
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"pair{rec['pair']:02d}.json"), "w") as f:
        json.dump(rec, f)


def test_report_merges_two_machines_keeps_ratios_within_pair_and_flags_mixed_pairs(tmp_path):
    a, b = _machine("GPU-aaaa", "host-a"), _machine("GPU-bbbb", "host-b")
    c1, c2, c3, c4 = _call("c1"), _call("c2", "ray job submit"), _call("c3"), _call("c4")
    # (pair, flame req/s, engine req/s, flame's machine+call, engine's machine+call); tarballs of 4 calls
    plan = [(0, 10.0, 10.0, (a, c1), (a, c1)), (1, 11.0, 10.0, (a, c1), (a, c1)), (2, 12.0, 10.0, (b, c2), (b, c2)),
            (3, 13.0, 8.0, (a, c3), (b, c4))]  # pair 3: its sides ran on different machines
    for p, f, e, (fm, fc), (em, ec) in plan:
        _write(tmp_path, fc["id"], _raw("flame", p, p % 2, f, fm, fc))
        _write(tmp_path, ec["id"], _raw("engine", p, 1 - p % 2, e, em, ec))
    # call c1's tarball extracted a second time elsewhere: the same records, kept once
    shutil.copytree(tmp_path / "c1", tmp_path / "c1-again")
    rep = report.write_report(str(tmp_path), None, ["flame", "engine"])
    t = rep["traces"]["reuse"]
    fl, en = t["stats"]["flame"], t["stats"]["engine"]
    assert (fl["runs"], en["runs"]) == (4, 4)
    assert fl["req_s"] == {"median": 11.5, "min": 10.0, "max": 13.0}
    assert en["req_s"] == {"median": 10.0, "min": 8.0, "max": 10.0}
    assert fl["cached_pct"] == pytest.approx(50.0)
    (r,) = t["ratios"]
    assert r["ratio_of_medians"] == pytest.approx(1.15)  # medians pool every machine's runs
    # paired ratios only within one call on one machine: pair 3 (13 / 8 = 1.625) is left out
    assert r["paired"] == {0: pytest.approx(1.0), 1: pytest.approx(1.1), 2: pytest.approx(1.2)}
    assert (r["paired_min"], r["paired_max"], r["pairs"], r["pairs_at_or_above_floor"]) == \
        (pytest.approx(1.0), pytest.approx(1.2), 3, 3)
    prov = t["provenance"]
    assert {k: m["pairs"] for k, m in prov["machines"].items()} == {"M1": [0, 1, 3], "M2": [2, 3]}
    assert prov["machines"]["M2"]["gpus"][0]["uuid"] == "GPU-bbbb" and prov["machines"]["M2"]["host"] == "host-b"
    assert [(x["pair"], x["machine"], x["call"], x["via"]) for x in prov["pairs"]] == [
        (0, "M1", "c1", "direct"), (1, "M1", "c1", "direct"), (2, "M2", "c2", "ray job submit"),
        (3, "M2,M1", "c4,c3", "direct")]  # in run order
    assert list(prov["mixed"]) == [3] and "different machines (M1, M2)" in prov["mixed"][3]
    assert any(w.startswith("pair 3 is left out of the paired ratios") for w in t["warnings"])
    assert any("the runs come from 2 machines" in w for w in t["warnings"])
    md = open(tmp_path / "report.md").read()
    assert "| M2 | NVIDIA H200 `GPU-bbbb` | host-b | 2, 3 |" in md
    assert "(the first record's; the pairs ran on 2 machines, listed below)" in md  # the header's placement is one
    assert "| 2 | M2 | c2 | ray job submit | abc1234 |" in md
    assert "launched via: direct, ray job submit" in md and "**left out: its runs ran on different machines" in md
    assert "| flame / engine | 1.1500 | [1.0000-1.2000] | 3/3 |" in md
    assert "11.500 [10.000-13.000]" in md and "| 50.00 |" in md
    saved = json.load(open(tmp_path / "report.json"))["traces"]["reuse"]["provenance"]
    assert saved["mixed"] == {"3": prov["mixed"][3]}


def test_report_flags_a_pair_from_two_calls_on_one_machine_and_reads_older_records(tmp_path):
    a = _machine("GPU-aaaa", "host-a")
    for p, cf, ce in ((0, "c1", "c1"), (1, "c2", "c3")):
        _write(tmp_path, "x", _raw("flame", p, 0, 12.0, a, _call(cf)))
        _write(tmp_path, "x", _raw("engine", p, 1, 10.0, a, _call(ce)))
    _write(tmp_path, "old", _raw("flame", 2, 0, 9.0, None, None))  # before provenance: host and placement only
    _write(tmp_path, "old", _raw("engine", 2, 1, 10.0, None, None))
    t = report.build_report(report.load_runs(str(tmp_path)), ["flame", "engine"])["traces"]["reuse"]
    assert t["provenance"]["mixed"] == {1: "its runs came from different calls (c2, c3)"}
    assert t["ratios"][0]["paired"] == {0: pytest.approx(1.2), 2: pytest.approx(0.9)}
    old = t["provenance"]["machines"]["M2"]
    assert (old["id"], old["host"], old["pairs"]) == ("GPU-legacy", "legacy-host", [2])
    assert t["provenance"]["pairs"][2]["call"] == "None" and t["provenance"]["pairs"][2]["via"] == "unknown"


def test_report_header_names_no_other_machines_when_one_ran_every_pair(tmp_path):
    a = _machine("GPU-aaaa", "host-a")
    for p in (0, 1):
        _write(tmp_path, "x", _raw("flame", p, 0, 12.0, a, _call(f"c{p}")))
        _write(tmp_path, "x", _raw("engine", p, 1, 10.0, a, _call(f"c{p}")))
    md = report.render_markdown(report.build_report(report.load_runs(str(tmp_path)), ["flame", "engine"]), "x")
    assert "shard -> device" in md and "the first record's" not in md


def test_report_refuses_two_different_runs_of_one_pair(tmp_path):
    a = _machine("GPU-aaaa", "host-a")
    _write(tmp_path, "one", _raw("flame", 0, 0, 12.0, a, _call("c1")))
    _write(tmp_path, "two", _raw("flame", 0, 0, 11.0, a, _call("c2")))  # a --pair-start reused in another call
    with pytest.raises(ValueError, match=r"two runs claim trace 'reuse' system 'flame' pair 0: .*call c1.*call c2"):
        report.load_runs(str(tmp_path))


def test_pairs_refuses_to_reuse_a_pair_index_in_its_out_before_starting(tmp_path):
    _write(tmp_path, "", _raw("engine", 0, 0, 10.0, None, None))
    _write(tmp_path, "", _raw("engine", 1, 0, 10.0, None, None))
    # another system, same trace and pair: a pair index belongs to one call
    with pytest.raises(SystemExit, match=r"already holds raw/reuse/engine/pair01.json .* --pair-start 2"):
        pairs.main(["--systems", "flame,vllm", "--traces", "reuse", "--pairs", "2", "--pair-start", "1",
                    "--out", str(tmp_path), *SCALE])
    assert not (tmp_path / "bench.json").exists() and not (tmp_path / "calls").exists()
    pairs.check_pairs_free(str(tmp_path), ["reuse"], range(2, 4))  # past them: free
    pairs.check_pairs_free(str(tmp_path), ["no-reuse"], range(0, 2))  # another trace: free


def test_source_digest_covers_code_not_records(tmp_path, monkeypatch):
    """bench/results is left out (ray job submit does not upload it): a job and a direct call of one tree agree."""
    for rel in ("flame_llm/a.py", "bench/b.py", "bench/results/run1/table.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    monkeypatch.setattr(provenance, "REPO", str(tmp_path))
    first = provenance.source_digest()
    (tmp_path / "bench/results/run1/table.py").write_text("x = 2\n")
    (tmp_path / "bench/results/run2").mkdir()
    (tmp_path / "bench/results/run2/more.py").write_text("y = 1\n")
    assert provenance.source_digest() == first
    (tmp_path / "bench/b.py").write_text("x = 2\n")
    assert provenance.source_digest() != first


def test_provenance_names_machine_code_and_launch(monkeypatch):
    m = provenance.machine_info()
    assert m["host"] and (m["id"] == f"host:{m['host']}" or m["id"].startswith("GPU-"))
    assert len(provenance.source_digest()) == 16
    monkeypatch.setenv(provenance.COMMIT_ENV, "feedbeef")
    monkeypatch.delenv(provenance.JOB_ENV, raising=False)
    c = provenance.call_info(3, 2, ["x"])
    assert (c["commit"], c["via"], c["pair_start"], c["pairs"]) == ("feedbeef", "direct", 3, 2)
    monkeypatch.setenv(provenance.JOB_ENV, json.dumps({"runtime_env": {}, "metadata": {"job_submission_id": "j1"}}))
    assert provenance.launch() == {"via": "ray job submit", "submission_id": "j1"}
    monkeypatch.delenv(provenance.COMMIT_ENV)
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert provenance.commit().startswith(head)


def _gpu_setup() -> system_config.Setup:
    return system_config.Setup(model="/m", model_revision="m@1", devices=["GPU-a"], engine={
        "max_model_len": 32768, "max_num_seqs": 64, "max_num_batched_tokens": 8192, "enable_prefix_caching": True})


def test_round_robin_over_one_shard_is_refused_before_anything_starts(tmp_path):
    """flame-rr over one shard places every request where flame would: an affinity A/B on one GPU measures
    nothing, so bench.burst.pairs (burst and load) refuses it; two shards (the CPU default) are accepted."""
    for mode in ("burst", "load"):
        with pytest.raises(SystemExit, match=r"flame-rr: round-robin placement needs 2 or more shards .* 1 planned"):
            pairs.main(["--mode", mode, "--systems", "flame,flame-rr", "--num-shards", "1", "--rates", "1",
                        "--out", str(tmp_path / mode)])
        assert not (tmp_path / mode).exists()  # refused before any record or Ray start
    parser = argparse.ArgumentParser()
    pairs.add_arguments(parser)
    o = runner.options_from_args(parser.parse_args(["--systems", "flame,flame-rr"]))
    runner.check_round_robin(["flame", "flame-rr"], o)  # no GPU here: two CPU shards


def test_the_issues_systems_and_their_command_lines(monkeypatch):
    """flame, engine, vllm (default), vllm-seed (eager + Triton attention, the seed's), flame-rr (round-robin)."""
    monkeypatch.setattr(http_system, "gpu_index", {"GPU-a": 0}.get)
    got = {s: parse_system(s) for s in ("flame", "engine", "vllm", "vllm-seed", "flame-rr")}
    assert {s: (c.kind, c.vllm_config, c.policy) for s, c in got.items()} == {
        "flame": ("flame", None, "cumulative"), "engine": ("engine", None, "cumulative"),
        "vllm": ("vllm", "default", "cumulative"), "vllm-seed": ("vllm", "seed", "cumulative"),
        "flame-rr": ("flame", None, "round_robin")}
    cmds = {s: http_system.HttpSystem(got[s], _gpu_setup(), "t").command("GPU-a", 8000)[0]
            for s in ("engine", "vllm", "vllm-seed")}
    assert cmds["engine"][1:3] == ["-m", "flame_llm.serving.http_server"]
    base = cmds["vllm"]
    assert base[:3] == ["vllm", "serve", "/m"] and "--enforce-eager" not in base and "--attention-backend" not in base
    assert cmds["vllm-seed"] == base + ["--enforce-eager", "--attention-backend", "TRITON_ATTN"]  # vLLM 0.26's flags
    from flame_llm.serving.service_config import ServiceConfig  # the policy flame-rr hands the service is valid
    assert ServiceConfig.from_kwargs(model="/m", policy="round_robin").router.policy == "round_robin"


def test_fp8_labels_set_the_fused_producers_flag():
    """flame-fp8 takes the engine's default (fused producers on, session 23); -unfused is that flag's A/B."""
    assert parse_system("flame-fp8").engine == {"quantization": "fp8"}
    for label in ("flame-fp8-unfused", "engine-fp8-unfused"):
        assert parse_system(label).engine == {"quantization": "fp8", "fp8_fused_quant": False}
    assert parse_system("engine-fp8-unfused").kind == "engine"


@pytest.mark.slow
def test_one_traces_pairs_through_ray_job_submit(tmp_path):
    """What `bash bench/device_run.sh jobpairs` runs on the GPU machine, on CPU: bench.burst.jobpairs starts a Ray head
    of
    its own (free ports, its own temp dir: other Ray clusters on this machine are left alone), submits bench.burst.pairs
    with `ray job submit --working-dir <repo>`, fetches the job's logs and stops the head; the raw records and the
    report say the pairs ran through `ray job submit`."""
    os.environ.pop("RAY_ADDRESS", None)
    out = str(tmp_path / "job")
    rc = jobpairs.main(["--out", out, "--num-cpus", "2", "--num-gpus", "0", "--submission-id", "pairs-test", "--",
                        "--systems", "flame,engine", "--traces", "reuse", "--pairs", "1", *SCALE])
    job = json.load(open(os.path.join(out, "jobs", "pairs-test.json")))
    logs = open(os.path.join(out, "jobs", "pairs-test.log")).read()
    assert rc == 0 and job["rc"] == 0, (job, logs[-3000:])
    assert job["status"] == "SUCCEEDED" and "| flame / engine |" in logs
    for label in ("flame", "engine"):
        raw = json.load(open(os.path.join(out, "raw", "reuse", label, "pair00.json")))
        assert raw["call"]["via"] == "ray job submit" and raw["call"]["submission_id"] == "pairs-test"
        assert raw["checks"]["ok"], raw["checks"]
    rep = report.write_report(out)
    assert [x["via"] for x in rep["traces"]["reuse"]["provenance"]["pairs"]] == ["ray job submit"]
    assert "launched via: ray job submit" in open(os.path.join(out, "report.md")).read()
    head_gone = subprocess.run(["ray", "job", "list", "--address", job["address"]], env=jobpairs.ray_env(),
                               capture_output=True, timeout=60)
    assert head_gone.returncode != 0  # the head was stopped


def test_jobpairs_refuses_out_after_the_separator_and_reports_a_head_that_fails_to_start(tmp_path):
    with pytest.raises(SystemExit, match="give --out to bench.burst.jobpairs"):
        jobpairs.main(["--out", str(tmp_path), "--", "--traces", "reuse", "--out", "x"])
    # a temp dir under a file: refused before any Ray process starts (with -1 CPUs the refusal came at the raylet,
    # after the dashboard, whose job API could answer first on a loaded machine: a race, seen under two xdist workers)
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    blocker = os.path.join(temp, "a-file")
    open(blocker, "w").close()
    head, address = jobpairs.start_head(1, 0, os.path.join(blocker, "ray"), str(tmp_path / "start.log"))
    try:
        with pytest.raises(RuntimeError, match="ray start --head exited with"):
            jobpairs.wait_jobs_api(head, address, timeout_s=120)
    finally:
        jobpairs.stop_head(head)
        shutil.rmtree(temp, ignore_errors=True)
    assert "Not a directory" in (tmp_path / "start.log").read_text()
