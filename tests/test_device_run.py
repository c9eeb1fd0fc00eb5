"""bench/device_run.sh's bg, wait and seq stages, on CPU (the stage runs here as on the GPU machine; nvidia-smi and
flash-attn are missing, which the script only prints): a stage started with `bg` runs on in a process session of
its own after the call returns and its process group is killed (as the device tool does); `wait` holds the call
until it ends and brings back its $OUT, or, while it still runs, its $OUT so far and what RDIR holds."""
import contextlib
import json
import os
import signal
import subprocess
import tarfile
import time
import urllib.request

import pytest
from servers import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *args: str, timeout_s: float = 120, **env: str) -> subprocess.CompletedProcess:
    out = tmp_path / f"out{time.monotonic_ns()}"
    out.mkdir()
    # CACHES_IN: not the checkout's own .caches/, which holds a real session's caches where one was kept
    full = {**os.environ, "BG_DIR": str(tmp_path / "bg"), "OUT": str(out), "CACHES_IN": str(tmp_path / "none"),
            **env}
    proc = subprocess.Popen(["bash", "bench/device_run.sh", *args], cwd=REPO, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    stdout, stderr = proc.communicate(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):  # as the device tool ends what a call leaves in its group
        os.killpg(proc.pid, signal.SIGKILL)
    p = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    p.out = out
    return p


def test_a_background_stage_outlives_its_call_and_wait_brings_back_its_out(tmp_path):
    started = _run(tmp_path, "bg", "py", "-c", "import os, time; time.sleep(2); "
                   "open(os.environ['OUT'] + '/done.txt', 'w').write('yes'); print('BG-SAID-THIS')")
    assert "started in the background" in started.stdout, started.stdout + started.stderr
    again = _run(tmp_path, "bg", "sleep", "1")
    assert again.returncode == 3 and "a background stage runs" in again.stdout
    waited = _run(tmp_path, "wait", WAIT_S="60", WAIT_POLL_S="0.5")  # not every 5 s: it ends ~2 s in
    assert "background stage ended: rc 0" in waited.stdout and "BG-SAID-THIS" in waited.stdout
    assert (waited.out / "done.txt").read_text() == "yes"


def test_wait_returns_at_its_limit_with_the_results_so_far(tmp_path):
    rdir = tmp_path / "r"
    (rdir / "raw").mkdir(parents=True)
    (rdir / "raw" / "pair01.json").write_text("{}")
    _run(tmp_path, "bg", "py", "-c", "import os, time; open(os.environ['OUT'] + '/early.txt', 'w').write('x'); "
         "time.sleep(30)")
    time.sleep(2)
    t0 = time.monotonic()
    waited = _run(tmp_path, "wait", WAIT_S="1", WAIT_POLL_S="0.5", RDIR=str(rdir))
    assert time.monotonic() - t0 < 25 and "still running" in waited.stdout
    # what its finished stages wrote to $OUT comes back too (a later stage may fail or the machine go back)
    assert (waited.out / "early.txt").read_text() == "x"
    with tarfile.open(waited.out / "progress.tgz") as t:
        assert "r/raw/pair01.json" in t.getnames()
    os.killpg(int((tmp_path / "bg" / "pid").read_text()), signal.SIGKILL)  # its own session: the group is the stage


def test_wait_without_a_background_stage_says_so(tmp_path):
    waited = _run(tmp_path, "wait", WAIT_S="1")
    assert waited.returncode == 3 and "no background stage" in waited.stdout


def test_seq_runs_each_stage_with_its_environment_and_goes_on_past_a_failure(tmp_path):
    script = tmp_path / "say.py"
    script.write_text("import os\nprint('SAID', os.environ.get('FLAME_SEQ_TEST', 'unset'))\n")
    p = _run(tmp_path, "seq", f"FLAME_SEQ_TEST=7 py {script}", "no-such-stage", f"py {script}")
    assert p.returncode == 2, p.stdout + p.stderr  # the unknown stage's status
    assert "SAID 7" in p.stdout and "SAID unset" in p.stdout and "unknown stage no-such-stage" in p.stdout


def test_compile_caches_saved_after_a_stage_come_back_and_a_later_call_restores_them(tmp_path):
    saved_root = tmp_path / "machine1"
    write = ("import os; d = os.environ['TRITON_CACHE_DIR']; os.makedirs(d); "
             "open(d + '/kernel.bin', 'w').write('compiled'); "
             "open(d + '/big.bin', 'wb').write(bytes(range(256)) * 4 + os.urandom(1_600_000)); print('WROTE')")
    # parts of 1.5 MB, not the real 15 (the same split at a tenth of the size: xz over 16 MB of noise took ~15 s)
    p = _run(tmp_path, "py", "-c", write, WARM_CACHES="1", SAVE_CACHES="1", CACHE_ROOT=str(saved_root),
             SAVE_CACHES_PART_BYTES="1500000")
    assert p.returncode == 0 and "compile caches saved" in p.stdout, p.stdout + p.stderr
    parts = sorted(p.out.glob("caches.tar.xz.*"))
    assert [x.name for x in parts] == ["caches.tar.xz.0", "caches.tar.xz.1"]  # 1.6 MB do not fit one 1.5 MB part
    carried = tmp_path / "carried"  # what a later call carries as .caches/
    carried.mkdir()
    for part in parts:
        part.rename(carried / part.name)
    # a fresh machine: the parts carried into the call are unpacked once, before the stage
    fresh = tmp_path / "machine2"
    read = ("import os; d = os.environ['TRITON_CACHE_DIR']; "
            "print('GOT', open(d + '/kernel.bin').read(), os.path.getsize(d + '/big.bin'))")
    q = _run(tmp_path, "py", "-c", read, WARM_CACHES="1", CACHE_ROOT=str(fresh), CACHES_IN=str(carried))
    assert "compile caches restored" in q.stdout and "GOT compiled 1601024" in q.stdout, q.stdout + q.stderr
    again = _run(tmp_path, "py", "-c", read, WARM_CACHES="1", CACHE_ROOT=str(fresh), CACHES_IN=str(carried))
    assert "compile caches restored" not in again.stdout and "GOT compiled" in again.stdout


def test_save_caches_without_caches_says_so_and_keeps_the_stage_status(tmp_path):
    p = _run(tmp_path, "py", "-c", "raise SystemExit(5)", SAVE_CACHES="1", CACHE_ROOT=str(tmp_path / "empty"))
    assert "no compile caches" in p.stdout and not list(p.out.glob("caches*")), p.stdout
    # the py stage pipes through grep, so its status is the pipeline's; the save must not turn a failure into 0
    plain = _run(tmp_path, "py", "-c", "raise SystemExit(5)", CACHE_ROOT=str(tmp_path / "empty"))
    assert plain.returncode != 0 and p.returncode == plain.returncode


def test_caches_too_large_to_come_back_are_not_saved_in_part(tmp_path):
    write = ("import os; d = os.environ['TRITON_CACHE_DIR']; os.makedirs(d); "
             "open(d + '/kernel.bin', 'w').write('compiled'); print('WROTE')")
    p = _run(tmp_path, "py", "-c", write, WARM_CACHES="1", SAVE_CACHES="1", SAVE_CACHES_MAX_PARTS="0",
             CACHE_ROOT=str(tmp_path / "root"))
    assert "compile caches not saved" in p.stdout and "over 0" in p.stdout, p.stdout + p.stderr
    assert not list(p.out.glob("caches*")) and p.returncode == 0


def test_a_damaged_cache_part_is_reported_and_the_stage_still_runs_cold(tmp_path):
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "caches.tar.xz.0").write_bytes(b"not an xz stream")
    root = tmp_path / "root"
    p = _run(tmp_path, "py", "-c", "print('STAGE-RAN')", WARM_CACHES="1", CACHE_ROOT=str(root),
             CACHES_IN=str(carried))
    assert "caches not restored" in p.stdout and "STAGE-RAN" in p.stdout, p.stdout + p.stderr
    assert not (root / ".caches-restored").exists()


def test_the_external_stage_refuses_an_unknown_door_before_it_starts_a_server(tmp_path):
    p = _run(tmp_path, "external", DOORS="serve-http,sglang")
    assert p.returncode == 2 and "unknown door sglang in DOORS (serve-http, serve, vllm)" in p.stdout, p.stdout
    assert not list(p.out.iterdir())  # no server was started, no log written


@pytest.mark.serial
@pytest.mark.slow
def test_the_external_stage_measures_both_front_doors(tmp_path):
    """`DOORS=serve-http,serve bash bench/device_run.sh external` as on the GPU, with the tiny model on CPU (vLLM's
    client from .ci/run's unpacked wheel): vLLM's client against serve-http, then against `flame-llm serve` (two
    Ray shards), each run's record with zero failed and our /metrics agreeing; the servers are gone after it."""
    site = os.path.join(os.path.expanduser("~"), ".cache", "flame_llm", "vllm-bench-site")
    if not os.path.isdir(os.path.join(site, "vllm")):
        pytest.skip(f"vLLM's bench client is not unpacked at {site} (.ci/run does it)")
    port = free_port()
    service = {"placement": {"num_shards": 2, "cpu_per_shard": 0.5}, "shard": {"torch_threads": 1},
               "ray": {"num_cpus": 2}, "engine": {"cpu_kvcache_gib": 0.0625}}
    p = _run(tmp_path, "external", "--num-prompts", "4", "--rate", "inf", timeout_s=540, MODEL="tiny",
             DOORS="serve-http,serve", MAX_MODEL_LEN="512", MAX_NUM_SEQS="16", EXTERNAL_PORT=str(port),
             VLLM_SITE=site, SERVICE_JSON=json.dumps(service))
    assert p.returncode == 0 and "every run ok" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    with open(p.out / "external" / "summary.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["target"] for r in records] == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 2}"]
    for r in records:
        assert r["client"] == "vllm" and r["rate"] == "inf" and r["completed"] == 4 and r["failed"] == 0, r
        assert r["server_answered_200"] == 4 and r["server_not_ok"] == {}, r
    assert "listening on" in (p.out / "flame-service.log").read_text()  # the serve door's own log came back
    for url in (r["target"] for r in records):  # both servers were stopped
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{url}/health", timeout=2)
