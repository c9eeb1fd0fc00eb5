"""Burst benchmark on CPU: the real pairs driver, runner, systems (flame on a local Ray, engine as HTTP server
processes) and report, on the tiny model with scaled-down traces; plus the pieces that need no engine."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from bench import cli, http_system, system_config
from bench.burst import pairs, report
from bench.burst.runner import check_run
from bench.burst.traces import TraceConfig, make_trace, warmup_traces
from bench.system_config import parse_system

SCALE = ["--model", "tiny", "--load-format", "auto", "--docs", "4", "--questions", "2", "--doc-tokens", "256",
         "--question-tokens", "16", "--max-model-len", "1024", "--max-num-batched-tokens", "512",
         "--max-num-seqs", "16", "--engine-json", '{"cpu_kvcache_gib": 0.0625}', "--policy", "cumulative",
         "--warmup-rounds", "1"]  # one round: the measured burst's service figures still exclude it (the diff)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**kw) -> TraceConfig:
    return TraceConfig(**{"num_docs": 3, "questions": 2, "doc_tokens": 40, "question_tokens": 5, "vocab_size": 97,
                        **kw})


def test_traces_are_seeded_shuffled_and_warmups_keep_prefix_relations_with_unseen_ids():
    cfg = _config()
    t, again, other = make_trace(cfg), make_trace(cfg), make_trace(_config(seed=1))
    assert [r.prompt_digest for r in t.requests] == [r.prompt_digest for r in again.requests]
    assert [r.prompt_digest for r in t.requests] != [r.prompt_digest for r in other.requests]
    assert len(t.requests) == 6 and all(len(r.token_ids) == 45 for r in t.requests)
    assert [r.rid for r in t.requests] != sorted(r.rid for r in t.requests)  # shuffled (seed 0)
    assert make_trace(_config(name="no-reuse")).config.num_requests == 3
    warm = warmup_traces(cfg, 2)
    assert len({w.shift for w in warm}) == 2 and all(w.shift % 97 for w in warm)
    docs = {r.doc: r.token_ids[:40] for r in t.requests}
    for w in warm:
        for r in w.requests:
            assert len(r.token_ids) == 45 and r.token_ids.max() < 97
            assert np.array_equal(r.token_ids[:40], (docs[r.doc] + w.shift) % 97)  # same doc, same shifted prefix
            assert not any(np.array_equal(r.token_ids[:40], d) for d in docs.values())
    d = t.describe()
    assert d["seed"] == 0 and d["prompt_tokens"] == 45 and "generated" in d["token_source"]
    with pytest.raises(ValueError, match="trace field 'num_docs' must be an integer >= 1; got 0"):
        _config(num_docs=0)


def test_system_labels():
    assert parse_system("vllm-seed-rr").vllm_config == "seed"
    # issue 40: FP8 on both sides, the same scheme (W8A8, dynamic per-token activation scales)
    assert parse_system("vllm-fp8").vllm_config == "fp8" and parse_system("vllm").vllm_config == "default"
    assert parse_system("flame-fp8").engine == parse_system("engine-fp8").engine == {"quantization": "fp8"}
    assert parse_system("flame-fp8kv").engine == {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    # issue 39: the step loop in a process of its own
    assert parse_system("flame-proc").engine == parse_system("engine-proc").engine == {"engine_process": True}
    assert parse_system("engine-proc").kind == "engine" and parse_system("flame-proc").kind == "flame"
    assert parse_system("vllm-seed-rr").policy == "round_robin" and parse_system("engine", "cumulative").policy == \
        "cumulative"
    with pytest.raises(ValueError, match="system must be one of flame, flame-nomix, flame-mix2k, "
                                         "flame-noprune, flame-noearly, engine, engine-nomix, engine-mix2k, "
                                         "engine-noprune, engine-noearly, flame-gil, engine-gil, vllm, vllm-seed, "
                                         "flame-fp8, engine-fp8, "
                                         "vllm-fp8, flame-fp8kv, engine-fp8kv, flame-proc, engine-proc"):
        parse_system("sglang")
    rr = parse_system("flame-rr")
    assert (rr.kind, rr.client, rr.policy) == ("flame", {}, "round_robin")
    assert parse_system("flame").client == {}  # the ClientConfig defaults
    for retired in ("flame-batch", "flame-raystream", "flame-noresume", "flame-noreroute"):  # issue 38
        with pytest.raises(ValueError, match="system must be one of"):
            parse_system(retired)
    # the mixed-step graphs' one-flag A/B: the label sets the engine field, nothing else
    nomix = parse_system("flame-nomix")
    assert (nomix.kind, nomix.engine, nomix.client) == ("flame", {"cuda_graph_mixed_tokens": 0}, {})
    assert parse_system("engine-nomix-rr").kind == "engine" and parse_system("flame").engine == {}
    assert parse_system("engine-mix2k").engine == parse_system("flame-mix2k").engine == {
        "cuda_graph_mixed_tokens": 2048}
    # issue 19's last-layer pruning (on by default): the same one-flag A/B, the label turning it off
    prune = parse_system("engine-noprune")
    assert (prune.kind, prune.engine) == ("engine", {"prune_last_layer": False})
    assert parse_system("flame-noprune").engine == {"prune_last_layer": False}
    # the early hand-out before a long eager step's launch (on by default): the label turns it off
    late = parse_system("flame-noearly")
    assert (late.kind, late.engine, late.client) == ("flame", {"emit_before_long_launch": 0}, {})
    assert parse_system("engine-noearly").engine == {"emit_before_long_launch": 0}
    from flame_llm.config import EngineConfig
    # a label's fields are real, valid engine fields
    for label in ("engine-nomix", "engine-mix2k", "engine-noprune", "engine-noearly"):
        EngineConfig.from_kwargs(**parse_system(label).engine)


def _records(trace, placement=("cpu-0", "cpu-1")):
    return [{"id": r.rid, "shard": k % 2, "device": placement[k % 2], "prompt_tokens": len(r.token_ids),
             "output_len": 16, "finish_reason": "length", "prompt_digest": r.prompt_digest, "error": None}
            for k, r in enumerate(trace.requests)]


def test_checks_catch_missing_duplicate_length_hash_and_placement():
    trace = make_trace(_config())
    assert check_run(trace, _records(trace), ["cpu-0", "cpu-1"])["ok"]
    recs = _records(trace)
    recs[1] = dict(recs[0])  # request 1 missing, request 0 answered twice
    recs[2]["output_len"] = 15
    recs[3]["device"] = "cpu-1" if recs[3]["shard"] == 0 else "cpu-0"
    recs[4]["prompt_digest"] = "0" * 16
    recs[5]["error"] = {"code": "overloaded"}
    c = check_run(trace, recs, ["cpu-0", "cpu-1"])
    assert not c["ok"]
    assert c["failures"] == {"missing": 1, "duplicate": 1, "output_len": 1, "placement": 1, "prompt_digest": 1,
                             "error": 1}
    unreported = [{**rec, "prompt_digest": ""} for rec in _records(trace)]  # vLLM does not report a digest
    assert check_run(trace, unreported, ["cpu-0", "cpu-1"])["ok"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    os.environ.pop("RAY_ADDRESS", None)
    out = str(tmp_path_factory.mktemp("bench"))
    rc = pairs.main(["--systems", "flame,engine", "--traces", "no-reuse,reuse", "--pairs", "1", "--out", out,
                     *SCALE])
    return rc, out


def test_cpu_smoke_flame_vs_engine_runs_checks_and_reports_from_raw_records(smoke):
    rc, out = smoke
    assert rc == 0
    rep = json.load(open(os.path.join(out, "report.json")))
    md = open(os.path.join(out, "report.md")).read()
    for trace, n in (("no-reuse", 4), ("reuse", 8)):
        t = rep["traces"][trace]
        assert t["systems"] == ["flame", "engine"] and t["trace"]["num_requests"] == n
        rates = {}
        for label in ("flame", "engine"):
            raw = json.load(open(os.path.join(out, "raw", trace, label, "pair00.json")))
            assert raw["checks"] == {"ok": True, "failures": {}, "examples": [], "requests": n, "expected": n}
            assert len(raw["warmup_shifts"]) == 1
            reqs = raw["requests"]
            assert sorted(r["id"] for r in reqs) == sorted({r["id"] for r in reqs}) and len(reqs) == n
            assert all(r["device"] == ["cpu-0", "cpu-1"][r["shard"]] and r["output_len"] == 16 for r in reqs)
            # both systems report the digest of the prompt they served (the checks compared it with the trace's)
            assert all(len(r["prompt_digest"]) == 16 for r in reqs)
            owner = {}
            for r in reqs:  # cumulative placement: every question of a document on its document's shard
                assert owner.setdefault(r["doc"], r["shard"]) == r["shard"]
            rates[label] = n / max(r["done_s"] for r in reqs)
            s = t["stats"][label]
            assert s["req_s"]["median"] == pytest.approx(rates[label], rel=1e-12)
            cached = 100 * sum(r["cached_tokens"] for r in reqs) / sum(r["prompt_tokens"] for r in reqs)
            assert s["cached_pct"] == pytest.approx(cached)
            assert s["latency_s"]["p50"] == pytest.approx(float(np.percentile([r["done_s"] for r in reqs], 50)))
            assert f"{rates[label]:.3f}" in md
        # the service path of the measured burst alone (warmup rounds are excluded by the before/after diff)
        burst = json.load(open(os.path.join(out, "raw", trace, "flame", "pair00.json")))["stats"]["burst"]
        c, actors = burst["client"], burst["actors"]
        assert c["batches"] >= 1 and c["retries"] == 0 and sum(a["batches"] for a in actors) == c["batches"]
        assert sum(a["requests"] for a in actors) == n and c["route_calls"] >= 1
        assert c["payload_raw_bytes"] >= n * t["trace"]["prompt_tokens"] and 0 < c["payload_wire_bytes"]
        sp = t["stats"]["flame"]["service_path"]
        assert t["stats"]["engine"]["service_path"] is None
        assert sp["batches"] == c["batches"] and sp["prompts_per_batch"] == pytest.approx(n / c["batches"])
        assert sp["compression"] == pytest.approx(c["payload_raw_bytes"] / c["payload_wire_bytes"])
        assert sp["per_batch_ms"]["route"] == pytest.approx(1e3 * c["route_s"] / c["route_calls"])
        assert 0 < sp["service_share_of_burst"] < 1 and sp["admission_wait_p50_s"] >= 0
        (ratio,) = t["ratios"]
        assert ratio["ratio_of_medians"] == pytest.approx(rates["flame"] / rates["engine"])
        assert ratio["paired"] == {"0": pytest.approx(rates["flame"] / rates["engine"])}
    assert "## Trace `reuse`" in md and "flame / engine" in md and "Service path per measured burst" in md
    # one pair of sub-second bursts: the report says beside the ratios that they are not evidence
    assert md.count("**Warning: these ratios are not evidence.** only 1 complete pair(s)") == 2
    assert all(any("under 2 s" in w for w in rep["traces"][t]["warnings"]) for t in ("no-reuse", "reuse"))


def test_a_second_call_with_pair_start_merges_with_the_first_into_one_report(smoke, tmp_path):
    """The real driver on CPU (issue 20): the smoke's call ran pair 0; a second call, --pair-start 1, into a copy of
    its --out; one report over both calls, each pair traced to its call."""
    _, first = smoke
    out = str(tmp_path / "r")
    shutil.copytree(first, out)
    common = ["--systems", "flame,engine", "--traces", "reuse", "--pairs", "1", "--out", out, *SCALE]
    assert pairs.main([*common, "--pair-start", "1"]) == 0
    calls = sorted(os.listdir(os.path.join(out, "calls")))
    assert len(calls) == 2
    metas = sorted((json.load(open(os.path.join(out, "calls", c))) for c in calls),
                   key=lambda m: m["call"]["pair_start"])
    assert [m["call"]["pair_start"] for m in metas] == [0, 1]
    for p, meta in enumerate(metas):
        for label in ("flame", "engine"):
            raw = json.load(open(os.path.join(out, "raw", "reuse", label, f"pair{p:02d}.json")))
            assert raw["call"] == meta["call"] and raw["call"]["via"] == "direct"
            assert raw["machine"]["id"] == meta["machine"]["id"] and raw["checks"]["ok"]
    rep = json.load(open(os.path.join(out, "report.json")))  # written by the second call, over both
    t = rep["traces"]["reuse"]
    assert t["stats"]["flame"]["runs_ok"] == t["stats"]["engine"]["runs_ok"] == 2
    (r,) = t["ratios"]
    assert sorted(r["paired"]) == ["0", "1"] and r["pairs"] == 2
    prov = t["provenance"]
    assert list(prov["machines"]) == ["M1"] and prov["machines"]["M1"]["pairs"] == [0, 1] and not prov["mixed"]
    assert [x["call"] for x in prov["pairs"]] == [m["call"]["id"] for m in metas]
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert all(x["commit"].startswith(head) for x in prov["pairs"])
    assert rep["traces"]["no-reuse"]["stats"]["flame"]["runs_ok"] == 1  # the first call's other trace, kept
    # `flame-llm report DIR` over the same records: the same ratios
    again = report.write_report(out, str(tmp_path / "again"))["traces"]["reuse"]["ratios"][0]
    assert again["paired"] == {int(k): pytest.approx(v) for k, v in r["paired"].items()}
    with pytest.raises(SystemExit, match="--pair-start 2"):
        pairs.main([*common, "--pair-start", "1"])


def _stats(bursts: list[float]) -> dict:
    return {"per_run": [{"pair": k, "ok": True, "burst_s": b, "req_s": 10 / b} for k, b in enumerate(bursts)]}


def test_report_warns_when_pairs_are_too_few_or_bursts_too_short():
    ok = report.warnings({"a": _stats([3.0, 3.1, 2.9]), "b": _stats([3.2, 3.0, 3.1])}, [{"pairs": 3}])
    assert ok == []
    few = report.warnings({"a": _stats([3.0, 3.1]), "b": _stats([3.2, 3.0])}, [{"pairs": 2}])
    assert len(few) == 1 and "only 2 complete pair(s)" in few[0] and "--pairs 3" in few[0]
    short = report.warnings({"a": _stats([3.0, 0.4, 2.9]), "b": _stats([3.2, 3.0, 3.1])}, [{"pairs": 3}])
    assert len(short) == 1 and "0.400 s (under 2 s)" in short[0]


def test_bench_without_a_gpu_uses_the_tiny_model_and_checks_memory_first(monkeypatch):
    """`flame-llm bench` on a CPU machine defaulted to Llama-3.1-8B shapes and reached 14.6 GB of RAM in 33 s with
    no memory check; now the machine picks the defaults and serve's preflight runs before anything loads."""
    from bench import run_options
    from flame_llm.cli import build_parser

    parser = build_parser(cli.COMMANDS)
    monkeypatch.setattr(run_options, "has_gpu", lambda: False)
    o = run_options.options_from_args(parser.parse_args(["bench"]))
    assert (o.model, o.load_format, o.docs, o.doc_tokens) == ("tiny", "auto", 16, 1024)
    o = run_options.options_from_args(parser.parse_args(["bench", "--docs", "3", "--model", "some/dir"]))
    assert (o.model, o.docs, o.doc_tokens) == ("some/dir", 3, 1024)  # explicit flags win
    run_options.check_bench_memory(parser.parse_args(["bench"]), available=2 << 30)  # the CPU default fits in 2 GB
    big = parser.parse_args(["bench", "--model", "configs/models/llama-3.1-8b", "--load-format", "dummy"])
    with pytest.raises(RuntimeError, match=r"flame-llm bench --model configs/models/llama-3.1-8b needs ~3\d\.\d GB "
                                           r"per CPU shard .* x 2 shards .* leave out --model"):
        run_options.check_bench_memory(big, available=16 << 30)
    monkeypatch.setattr(run_options, "has_gpu", lambda: True)
    o = run_options.options_from_args(parser.parse_args(["bench"]))
    assert (o.model, o.docs, o.doc_tokens) == ("configs/models/llama-3.1-8b", 64, 8192)


def test_bench_refuses_a_model_too_big_for_this_machine_in_one_line(capsys):
    from bench import run_options
    from flame_llm.serving.preflight import available_memory_bytes

    if run_options.has_gpu() or available_memory_bytes() >= 64e9:
        pytest.skip("this machine could hold two float32 8B shards")
    assert cli.main(["bench", "--model", "configs/models/llama-3.1-8b", "--out", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "needs ~" in err and "leave out --model" in err


def test_bench_help_shows_every_default_and_ends_with_a_cpu_and_a_gpu_example(capsys, monkeypatch):
    import re
    import subprocess

    from bench import run_options

    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = capsys.readouterr().out
    options, _, epilog = text.partition("\nexamples:\n")
    flags = re.findall(r"^  (--[a-z-]+)", options, flags=re.M)
    assert len(flags) > 30
    for flag in flags:  # each flag's help runs until the next flag; it names its default
        part = options[options.index(f"  {flag}"):]
        nxt = re.search(r"\n  --", part[2:])
        assert "default" in (part[:nxt.start() + 2] if nxt else part), flag
    lines = [line.strip() for line in epilog.strip().splitlines()]
    assert lines[0].startswith("# CPU") and lines[1].startswith("flame-llm bench ")
    assert lines[2].startswith("# GPU") and lines[3].startswith("flame-llm bench ")
    # --out defaults to a path git ignores (it was bench/results/run, inside the tree and not ignored)
    for gpu in (False, True):
        monkeypatch.setattr(run_options, "has_gpu", lambda gpu=gpu: gpu)
        assert run_options.options_from_args(_parse_bench([])).out == "out/bench"
    o = run_options.options_from_args(_parse_bench([]))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ignored = subprocess.run(["git", "check-ignore", "-q", os.path.join(o.out, "raw", "reuse", "flame",
                                                                          "pair00.json")], cwd=repo)
    assert ignored.returncode == 0, o.out


def _parse_bench(argv: list[str]):
    from flame_llm.cli import build_parser
    return build_parser(cli.COMMANDS).parse_args(["bench", *argv])


def test_report_follows_edited_raw_records_and_excludes_failed_runs(smoke, tmp_path, monkeypatch):
    _, out = smoke
    path = os.path.join(out, "raw", "reuse", "engine", "pair00.json")
    raw = json.load(open(path))
    for r in raw["requests"]:
        r["done_s"] = 2.0  # 8 requests in 2 s
    os.makedirs(tmp_path / "raw" / "reuse" / "engine")
    json.dump(raw, open(tmp_path / "raw" / "reuse" / "engine" / "pair00.json", "w"))
    raw["pair"], raw["checks"] = 1, {**raw["checks"], "ok": False, "failures": {"output_len": 1}}
    json.dump(raw, open(tmp_path / "raw" / "reuse" / "engine" / "pair01.json", "w"))
    assert cli.main(["report", str(tmp_path)]) == 0  # `flame-llm report <raw dir>`
    rep = json.load(open(tmp_path / "report.json"))
    s = rep["traces"]["reuse"]["stats"]["engine"]
    assert s["req_s"] == {"median": 4.0, "min": 4.0, "max": 4.0} and (s["runs"], s["runs_ok"]) == (2, 1)
    assert "FAILED run `raw/reuse/engine/pair01.json`" in open(tmp_path / "report.md").read()
    try:
        import matplotlib  # noqa: F401
        assert rep["png"] == "report.png" and (tmp_path / "report.png").stat().st_size > 1000
    except ImportError:
        assert rep["png"] is None
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the PNG degrades away; md and json still come
    rep = report.write_report(str(tmp_path), str(tmp_path / "nopng"))
    assert rep["png"] is None and not (tmp_path / "nopng" / "report.png").exists()
    assert (tmp_path / "nopng" / "report.md").exists()
    with pytest.raises(ValueError, match="no raw run records"):
        report.load_runs(str(tmp_path / "raw" / "none"))


def test_trace_digest_is_the_protocols_prompt_digest():
    from flame_llm.protocol.types import prompt_digest
    (req,) = make_trace(_config(num_docs=1, name="no-reuse")).requests
    assert req.prompt_digest == prompt_digest(req.token_ids.tolist()) != prompt_digest(req.token_ids[:-1])


def _gpu_setup():
    return system_config.Setup(model="/m", model_revision="m@1", devices=["GPU-a", "GPU-b"], engine={
        "max_model_len": 32768, "max_num_seqs": 64, "max_num_batched_tokens": 8192, "enable_prefix_caching": True})


def test_vllm_replicas_get_the_protocol_flags_and_a_pci_index_for_their_uuid(monkeypatch):
    monkeypatch.setattr(http_system, "gpu_index", {"GPU-a": 0, "GPU-b": 1}.get)
    seed = http_system.HttpSystem(parse_system("vllm-seed"), _gpu_setup(), "t")
    cmd, env = seed.command("GPU-b", 8123)
    flags = " ".join(cmd)
    for want in ("serve /m", "--load-format dummy", "--max-model-len 32768", "--max-num-seqs 64",
                 "--max-num-batched-tokens 8192", "--enable-prefix-caching", "--enable-prompt-tokens-details",
                 "--skip-tokenizer-init", "--port 8123", "--enforce-eager --attention-backend TRITON_ATTN"):
        assert want in flags
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    cmd, _ = http_system.HttpSystem(parse_system("vllm"), _gpu_setup(), "t").command("GPU-a", 8124)
    assert "--enforce-eager" not in cmd and "TRITON_ATTN" not in cmd and "--quantization" not in cmd
    cmd, _ = http_system.HttpSystem(parse_system("vllm-fp8"), _gpu_setup(), "t").command("GPU-a", 8127)
    assert " --quantization fp8" in " ".join(cmd) and "--enforce-eager" not in cmd
    cmd, _ = http_system.HttpSystem(parse_system("engine-fp8"), _gpu_setup(), "t").command("GPU-a", 8128)
    assert json.loads(cmd[cmd.index("--engine-json") + 1])["quantization"] == "fp8"
    cmd, env = http_system.HttpSystem(parse_system("engine"), _gpu_setup(), "t").command("GPU-a", 8125)
    assert cmd[cmd.index("--gpu-uuid") + 1] == "GPU-a" and env["CUDA_VISIBLE_DEVICES"] == "GPU-a"
    assert json.loads(cmd[cmd.index("--engine-json") + 1])["device"] == "cuda"
    assert "cuda_graph_mixed_tokens" not in json.loads(cmd[cmd.index("--engine-json") + 1])
    cmd, _ = http_system.HttpSystem(parse_system("engine-nomix"), _gpu_setup(), "t").command("GPU-a", 8126)
    assert json.loads(cmd[cmd.index("--engine-json") + 1])["cuda_graph_mixed_tokens"] == 0


def test_gpu_process_placement_is_verified_by_pid_or_session(monkeypatch):
    import subprocess

    from bench import gpus

    me = os.getpid()
    # a real session leader (the way http_system.py starts servers); its pid is its session id
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        # nvidia-smi's process list cannot exist here: a fake one
        monkeypatch.setattr(gpus, "gpu_apps", lambda: [(me, "GPU-a"), (1, "GPU-z")])
        got = gpus.verify_processes(["GPU-a"], [me], by_session=False)
        assert got["verified_shards"] == [0] and [1, "GPU-z"] in got["unmapped_gpu_processes"]
        monkeypatch.setattr(gpus, "gpu_apps", lambda: [(child.pid, "GPU-a"), (me, "GPU-z")])
        got = gpus.verify_processes(["GPU-a"], [child.pid], by_session=True)
        assert got["verified_shards"] == [0] and [me, "GPU-z"] in got["unmapped_gpu_processes"]
        with pytest.raises(RuntimeError, match="shard 0 .* computes on GPU-a; planned GPU-b"):
            gpus.verify_processes(["GPU-b"], [child.pid, 0], by_session=False)
        monkeypatch.setattr(gpus, "gpu_apps", lambda: [(child.pid, "GPU-z")])
        with pytest.raises(RuntimeError, match="shard 0 .* computes on GPU-z; planned GPU-b"):
            gpus.verify_processes(["GPU-b"], [child.pid], by_session=True)
        # pid 0 (a session leader outside our namespace) never claims a process
        monkeypatch.setattr(gpus, "gpu_apps", lambda: [(me, "GPU-a")])
        assert gpus.verify_processes(["GPU-a"], [0], by_session=False)["verified_shards"] == []
    finally:
        child.kill()
        child.wait()


def test_host_step_times_only_full_decode_steps(tiny_llama, tmp_path):
    from bench.engine import host_step

    rows = host_step.main(["--model", tiny_llama, "--batches", "1,3", "--context", "40", "--block-size", "16",
                           "--steps", "4", "--out", str(tmp_path / "h.json")])
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert set(r["median_us"]) == {"schedule", "prepare", "postprocess"}
        assert all(v > 0 for v in r["median_us"].values()) and r["total_us"] == sum(r["median_us"].values())
    assert json.load(open(tmp_path / "h.json"))["rows"] == rows
