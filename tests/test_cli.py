"""CLI parsing, YAML config validation, the demo (the README's main job) as a subprocess, and
serve / submit / status / stop across processes on one real Ray cluster."""
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from flame_llm.cli import COMMANDS, build_parser, main
from flame_llm.cli_demo import DEMO_CONFIG
from flame_llm.serving.service_config import ServiceConfig, config_from_dict, load_service_config, reference_yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_one_default_namespace():
    assert "namespace" not in DEMO_CONFIG["ray"]  # serve --config configs/demo.yaml and submit/status/stop agree


def test_shipped_configs_load():
    svc = load_service_config(os.path.join(REPO, "configs", "service.yaml"))
    assert svc.engine.model_config.load_format == "dummy" and svc.engine.model_config.max_model_len == 32768
    assert svc.engine_kwargs() == {"load_format": "dummy", "max_model_len": 32768}  # chunked prefill: the default
    assert svc.placement.num_shards == "auto"
    demo = load_service_config(os.path.join(REPO, "configs", "demo.yaml"))
    assert demo.model == "tiny" and demo.placement.num_shards == 2
    assert load_service_config(os.path.join(REPO, "configs", "demo.yaml"), namespace="x").ray.namespace == "x"


def test_demo_yaml_is_the_built_in_demo_config():
    with open(os.path.join(REPO, "configs", "demo.yaml")) as f:
        assert yaml.safe_load(f) == DEMO_CONFIG


def test_reference_yaml_is_generated_from_the_dataclasses():
    """configs/service.reference.yaml lists every field with its default: it cannot drift from the code."""
    with open(os.path.join(REPO, "configs", "service.reference.yaml")) as f:
        text = f.read()
    assert text == reference_yaml(), "regenerate: python -m flame_llm.serving.service_config > " \
                                     "configs/service.reference.yaml"
    assert config_from_dict(yaml.safe_load(text), "reference") == ServiceConfig()


@pytest.mark.parametrize("raw, match", [
    ({"modle": "tiny"}, r"unknown field\(s\) \['modle'\]"),
    ({"num_shards": 2}, r"unknown field\(s\) \['num_shards'\] \(num_shards belongs in section 'placement'\)"),
    ({"placement": {"num_shards": 0}}, "'placement' field 'num_shards' must be 'auto' or an integer >= 1; got 0|"
                                      "placement field 'num_shards' must be 'auto' or an integer >= 1; got 0"),
    ({"placement": {"num_shards": "all"}}, "placement field 'num_shards' must be"),
    ({"placement": {"num_shard": 2}}, r"unknown field\(s\) \['num_shard'\] in section 'placement'"),
    ({"placement": [1]}, "section 'placement' must be a mapping of its fields"),
    ({"router": {"policy": "random"}}, "router field 'policy' must be one of"),
    ({"router": {"spill_factor": 0.5}}, "router field 'spill_factor' must be a number >= 1.0"),
    ({"client": {"max_batch_prompts": True}}, r"client field 'max_batch_prompts' must be an integer in \[1, 8192\]"),
    ({"client": {"max_batch_prompts": 8193}}, r"client field 'max_batch_prompts' must be an integer in .*; got 8193"),
    ({"client": {"batch_window_ms": -1}}, "client field 'batch_window_ms' must be a number in"),
    ({"shard": {"max_payload_bytes": 10}}, "shard field 'max_payload_bytes' must be an integer in"),
    ({"shard": {"zstd_level": 30}}, r"shard field 'zstd_level' must be an integer in \[-7, 19\]; got 30"),
    ({"shard": {"max_inflight_tokens": 0}}, "shard field 'max_inflight_tokens'"),
    ({"placement": {"max_restarts": -2}}, "placement field 'max_restarts' must be an integer >= -1"),
    ({"engine": {"max_num_seq": 4}}, r"unknown field\(s\) \['max_num_seq'\] in section 'engine'; known: .*"
                                     "max_num_seqs"),
    ({"engine": ["x"]}, "section 'engine' must be a mapping"),
    ({"engine": {"max_num_seqs": 0}}, "test.yaml: engine field 'max_num_seqs' must be an integer >= 1; got 0"),
    ({"engine": {"enable_chunked_prefill": "yes"}}, "engine field 'enable_chunked_prefill' must be true or false"),
    ({"engine": {"model": "x"}}, r"unknown field\(s\) \['model'\] in section 'engine'"),
    ({"ray": {"namespace": "a b"}}, "ray field 'namespace' must be"),
    ({"placement": {"gpu_uuids": "GPU-1"}}, "placement field 'gpu_uuids' must be a list"),
    ({"engine": {"load_format": "pt"}}, "engine field 'load_format' must be one of 'auto', 'dummy'; got 'pt'"),
    ({"load_format": "dummy"}, r"unknown field\(s\) \['load_format'\] \(load_format belongs in section 'engine'\)"),
    ({"ray": {"address": ""}}, "ray field 'address' must be"),
    ({"http": {"port": 70000}}, r"http field 'port' must be an integer in \[0, 65535\]"),
])
def test_config_errors_name_the_field(raw, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(raw, "test.yaml")


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="bad.yaml: not valid YAML"):
        load_service_config(str(bad))
    bad.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="top level must be a mapping"):
        load_service_config(str(bad))
    bad.write_text("shard:\n  zstd_level: 20\n")
    with pytest.raises(ValueError, match=r"bad.yaml: shard field 'zstd_level'"):
        load_service_config(str(bad))
    bad.write_text("")
    assert load_service_config(str(bad)) == ServiceConfig()


def test_flat_keywords_build_the_sections():
    cfg = ServiceConfig.from_kwargs(model="m", num_shards=3, policy="round_robin", namespace="ns", max_retries=2)
    assert (cfg.placement.num_shards, cfg.router.policy, cfg.ray.namespace, cfg.client.max_retries) == \
        (3, "round_robin", "ns", 2)
    with pytest.raises(ValueError, match="unknown service config field 'shards'"):
        ServiceConfig.from_kwargs(shards=3)


def test_engine_section_is_the_engines_own_config():
    """The engine section is parsed into flame_llm's EngineConfig once (flat names, load_format among them):
    from YAML, from flat keywords and from an `engine` mapping alike."""
    from flame_llm.config import EngineConfig
    cfg = ServiceConfig.from_kwargs(model="m", load_format="dummy", engine={"max_num_seqs": 8}, num_shards=2)
    assert cfg.engine == EngineConfig.from_kwargs(load_format="dummy", max_num_seqs=8)
    assert cfg.engine_kwargs() == {"load_format": "dummy", "max_num_seqs": 8}
    assert cfg == config_from_dict({"model": "m", "engine": {"load_format": "dummy", "max_num_seqs": 8},
                                    "placement": {"num_shards": 2}})
    with pytest.raises(ValueError, match="'max_num_seqs' is given twice"):
        ServiceConfig.from_kwargs(engine={"max_num_seqs": 8}, max_num_seqs=4)
    with pytest.raises(ValueError, match="engine field 'max_num_seqs' must be an integer >= 1; got 0"):
        ServiceConfig.from_kwargs(max_num_seqs=0)
    with pytest.raises(ValueError, match="service config field 'engine' must be an EngineConfig"):
        ServiceConfig(engine={"max_num_seqs": 8})



def _pyproject() -> dict:
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_the_installed_command_is_the_apps_and_bench_joins_through_an_entry_point():
    """`flame-llm` was bench.cli:main (the app's entry point in the benchmark package); now it is the app's, and
    the bench's commands come through the entry point group the app reads (no upward import)."""
    from importlib.metadata import EntryPoint

    from flame_llm.cli import COMMAND_GROUP

    project = _pyproject()["project"]
    assert project["scripts"]["flame-llm"] == "flame_llm.cli:main"
    group = project["entry-points"][COMMAND_GROUP]
    commands = {k: v for name, value in group.items() for k, v in EntryPoint(name, value, COMMAND_GROUP).load().items()}
    assert set(commands) == {"bench", "report"} and not set(commands) & set(COMMANDS)
    parser = build_parser({**COMMANDS, **commands})
    assert parser.parse_args(["report", "some-dir"]).func is commands["report"][0]
    assert "bench" not in COMMANDS  # the app knows nothing of the bench


def test_installed_commands_reads_the_entry_point_group(tmp_path, monkeypatch, caplog):
    """The discovery function over a real installed distribution's metadata (a dist-info on sys.path): its
    commands join the app's; one that fails to load is skipped with a warning; the app's own names are kept."""
    import importlib

    from flame_llm.cli import installed_commands

    (tmp_path / "extra_cmds.py").write_text(
        "def hello(args):\n    print('hello from extra')\n    return 0\n"
        "COMMANDS = {'hello': (hello, 'says hello', []), 'serve': (hello, 'not the app serve', [])}\n")
    info = tmp_path / "flame_extra-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flame-extra\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flame_test.commands]\nextra = extra_cmds:COMMANDS\n"
                                           "broken = no_such_module_here:COMMANDS\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    with caplog.at_level("WARNING", logger="flame_llm.cli"):
        found = installed_commands("flame_test.commands")
    assert set(found) == {"hello"} and found["hello"][1] == "says hello"
    assert "broken" in caplog.text and "no_such_module_here" in caplog.text
    assert main(["hello"], {**COMMANDS, **found}) == 0


def test_python_m_flame_llm_cli_runs_the_bench_commands():
    """Works wherever the metadata has the entry point (`pip install -e .`, as CI does); an editable install
    made before the entry point existed does not have it."""
    from importlib.metadata import entry_points

    from flame_llm.cli import COMMAND_GROUP

    if not list(entry_points(group=COMMAND_GROUP)):
        pytest.skip(f"the installed flame-llm metadata predates the {COMMAND_GROUP} entry points: pip install -e .")
    out = subprocess.run([sys.executable, "-m", "flame_llm.cli", "bench", "--help"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [REPO, *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert out.returncode == 0 and "examples:" in out.stdout, out.stderr[-2000:]


def test_parser_has_every_command_and_checks_arguments(capsys):
    parser = build_parser()
    for name in ("serve", "submit", "status", "stop", "demo"):
        assert parser.parse_args([name]).func is COMMANDS[name][0]
    args = parser.parse_args(["submit", "--num-prompts", "3", "--max-tokens", "5", "--namespace", "ns"])
    assert (args.num_prompts, args.max_tokens, args.namespace) == (3, 5, "ns")
    with pytest.raises(SystemExit):
        parser.parse_args(["submit", "--num-prompts", "many"])
    with pytest.raises(SystemExit):
        parser.parse_args(["launch"])


def test_cli_reports_user_errors(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "No such file" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny\n")
    with pytest.raises(SystemExit, match="--detach needs ray.address"):
        main(["serve", "--config", str(cfg), "--detach"])


@pytest.mark.parametrize("engine_json, words", [
    ('{"nonsense": 1}', "--engine-json: unknown config field(s) ['nonsense']; known: "),
    ("[1, 2]", "--engine-json must be a JSON object of flame_llm Config fields"),
    ("{not json", "--engine-json is not valid JSON"),
    ('{"max_num_seqs": 0}', "--engine-json: engine field 'max_num_seqs' must be an integer >= 1; got 0"),
])
def test_serve_http_names_a_bad_engine_field_in_one_line(capsys, engine_json, words):
    assert main(["serve-http", "--model", "tiny", "--engine-json", engine_json]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.serial  # the demo's local service refuses to start beside another Ray cluster, as serve does
def test_demo_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-m", "flame_llm.cli", "demo"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.split()[:3] == ["0", "cpu-0", "cpu-0"] for line in lines)
    assert any(line.split()[:3] == ["1", "cpu-1", "cpu-1"] for line in lines)
    assert "8/8 ok" in out.stdout
    rows = [line.split() for line in lines if line.split()[1:3] in (["0", "cpu-0"], ["1", "cpu-1"])]
    assert len(rows) == 8 and len({r[1] for r in rows}) == 2  # the two documents, one shard each
    # it says what it sends and why tokens are cached, and the expectation is what the shards report
    assert "sending 2 documents x 4 questions: 8 prompts of 300 + 12 random token ids, sharing 2 prefixes" in out.stdout
    (expect,) = [line.split("expect ~")[1].split("%")[0] for line in lines if "expect ~" in line]
    (summary,) = [line for line in lines if "8/8 ok" in line]
    assert expect == "61.5" and summary.endswith(f"({expect}%)"), (expect, summary)
    # the embedded default speaks text: a text prompt and a chat exchange, through its tokenizer and chat template
    text = out.stdout[out.stdout.index("text in, text out"):]
    assert "  prompt: 'The lighthouse keeper climbed the steps and'" in text and "  output: '" in text
    assert "  user: Is the lamp lit?" in text and "  assistant: '" in text


@pytest.mark.serial
def test_serve_submit_status_stop(tmp_path, tiny_llama):
    """The README's workflow across processes: serve (with its front door), then submit, status and stop from
    another process that sets neither RAY_AUTH_MODE nor --namespace (the token is found, the service too); stop
    ends the serve process and its local Ray. A process without the token is told so in one line."""
    cfg = tmp_path / "svc.yaml"
    cfg.write_text(yaml.safe_dump({"model": tiny_llama, "placement": {"num_shards": 2},
                                   "ray": {"namespace": "cli-test", "num_cpus": 2},
                                   "client": {"max_retries": 7, "batch_window_ms": 7.0},
                                   "engine": {"max_model_len": 512, "max_num_batched_tokens": 512,
                                              "cpu_kvcache_gib": 0.03125}}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    serve = subprocess.Popen([sys.executable, "-m", "flame_llm.cli", "serve", "--config", str(cfg), "--http-port",
                              "0"], cwd=tmp_path, env={**env, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, text=True)
    try:
        address, url, lines = None, None, []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = serve.stdout.readline()
            assert line, f"serve exited early: {lines}"
            lines.append(line)
            if "ray address:" in line:
                address = line.rsplit("ray address:", 1)[1].strip()
            if line.startswith("listening on "):
                url = line.split()[2]
            if line.startswith("serving"):
                break
        assert address and url and url.startswith("http://127.0.0.1:"), lines
        assert any("RAY_AUTH_MODE=token" in line for line in lines)
        import json
        import urllib.request
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps({"prompt": [5, 6, 7], "max_tokens": 3})
                                     .encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 3
        # two refusals, started together (each is a process start, seconds of imports on a loaded machine):
        # without the cluster's token: one line that says so, not Ray's twenty InvalidAuthToken warnings
        t0 = time.monotonic()
        denied_p = subprocess.Popen([sys.executable, "-m", "flame_llm.cli", "status", "--address", address],
                                    cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**env, "PYTHONPATH": REPO, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "no-token"),
                                         "RAY_gcs_server_port_wait_time_s": "2"})  # Ray gives up after 2 tries
        # a second serve on this machine is refused: one service, one local Ray, status never guesses between two
        second_p = subprocess.Popen([sys.executable, "-m", "flame_llm.cli", "serve", "--config", str(cfg)],
                                    cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**env, "PYTHONPATH": REPO})
        denied, second = (subprocess.CompletedProcess(p.args, None, *p.communicate(timeout=120))
                          for p in (denied_p, second_p))
        denied.returncode, second.returncode = denied_p.returncode, second_p.returncode
        assert denied.returncode == 2 and "uses token authentication" in denied.stderr, denied.stderr[-2000:]
        assert "InvalidAuthToken" not in denied.stderr and len(denied.stderr.strip().splitlines()) == 1
        print(f"both refusals took {time.monotonic() - t0:.1f}s")
        assert second.returncode == 2 and "a Ray cluster already runs on this machine" in second.stderr
        assert "flame-llm stop" in second.stderr and len(second.stderr.strip().splitlines()) == 1
        common = ["--address", address]
        out_file = tmp_path / "results.jsonl"
        steps = [["submit", *common, "--num-prompts", "4", "--prompt-len", "20", "--max-tokens", "3",
                  "--output", str(out_file)], ["status", *common], ["stop", *common]]
        # one client process runs the three commands in turn, with neither RAY_AUTH_MODE nor --namespace
        # the front door's client runs with the config file's `client` section (it once ran with the defaults)
        door_cfg = (f"import ray\nfrom flame_llm.serving.ray_attach import join\njoin({address!r}, 'cli-test')\n"
                    "c = ray.get(ray.get_actor('flame-frontdoor').client_config.remote())\n"
                    "print('== door', c.max_retries, c.batch_window_ms, flush=True)\nray.shutdown()\n")
        script = ("import sys\nfrom flame_llm.cli import main\n" + door_cfg +
                  f"for argv in {steps!r}:\n    print('== rc', main(argv), flush=True)\n")
        out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                             timeout=240, env={**env, "PYTHONPATH": REPO})
        assert "== door 7 7.0" in out.stdout, out.stdout + out.stderr[-3000:]
        parts = out.stdout.split("== rc ")
        assert [p.split()[0] for p in parts[1:]] == ["0", "0", "0"], out.stdout + out.stderr[-3000:]
        assert "4/4 ok" in parts[0] and len(out_file.read_text().splitlines()) == 4
        assert "cpu-0" in parts[1] and "cpu-1" in parts[1] and "hit rate" in parts[1] and "sticky" in parts[1]
        assert "stopped 2 engine actors and the front door in namespace 'cli-test'" in parts[2]
        t0 = time.monotonic()
        serve.wait(timeout=60)  # stop ended the serve process (and the local Ray it started)
        assert serve.returncode == 0 and time.monotonic() - t0 < 30
        assert "the service was stopped" in serve.stdout.read()
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                serve.kill()


def test_submit_arguments_and_prompt_files_are_checked(tmp_path, capsys):
    parser = build_parser()
    for argv, words in ((["submit", "--num-prompts", "0"], "--num-prompts: must be an integer >= 1; got 0"),
                        (["submit", "--vocab", "2"], "--vocab: must be an integer >= 4; got 2"),
                        (["submit", "--max-tokens", "0"], "--max-tokens: must be an integer >= 1")):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert words in capsys.readouterr().err
    bad = tmp_path / "p.jsonl"
    bad.write_text("[1, 2, 3]\n{not json\n")
    assert main(["submit", "--prompts", str(bad)]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
    bad.write_text("[1, 2]\n\n{\"a\": 1}\n")
    assert main(["submit", "--prompts", str(bad)]) == 2
    assert f"{bad}:3: a prompt must be a string or a list of token ids; got dict" in capsys.readouterr().err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    text = capsys.readouterr().out
    assert "(default: 8)" in text and "(default: 512)" in text
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--http-port" in capsys.readouterr().out


def test_cpu_memory_check_names_the_cpu_config(capsys):
    from flame_llm.serving.preflight import available_memory_bytes, check_cpu_memory, num_parameters

    cfg = load_service_config(os.path.join(REPO, "configs", "service.yaml"))
    with pytest.raises(RuntimeError, match=r"needs ~3\d\.\d GB per CPU shard \(8\.03B parameters x 4 bytes float32 "
                                           r"\+ 1\.1 GB KV cache\) x 2 shards = .* on CPU use configs/demo.yaml"):
        check_cpu_memory(cfg, os.path.join(REPO, "configs", "models", "llama-3.1-8b"), available=16 << 30)
    from flame_llm.config import load_hf_config
    assert abs(num_parameters(load_hf_config(os.path.join(REPO, "configs", "models", "llama-3.1-8b"))) - 8.03e9) < 1e7
    demo = load_service_config(os.path.join(REPO, "configs", "demo.yaml"))
    from flame_llm.models.tiny import resolve_model
    check_cpu_memory(demo, resolve_model("tiny"), available=2 << 30)  # the CPU config fits in 2 GB
    if available_memory_bytes() < 64e9:  # this machine cannot hold two float32 8B shards: serve says so at once
        t0 = time.monotonic()
        assert main(["serve", "--config", os.path.join(REPO, "configs", "service.yaml")]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "configs/demo.yaml" in err and time.monotonic() - t0 < 10
