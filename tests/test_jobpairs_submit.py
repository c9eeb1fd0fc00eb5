"""bench.burst.jobpairs.submit's answer to a Ray head that refuses a submission while its job agent registers ("No
available agent to submit job", seen once in CI right after the job API answered): the submission is made again.
That race cannot be forced on a real head, so these tests put a stand-in `ray` first on PATH (fake-ray-*/ray: it
says what a refusing head makes `ray job submit` say, then accepts); the real path is tests/test_pairs_report.py's
test_one_traces_pairs_through_ray_job_submit."""
import os
import stat

import pytest

from bench.burst import jobpairs

SCRIPT = """#!/usr/bin/env bash
n=$(( $(cat "{count}" 2>/dev/null || echo 0) + 1 ))
echo $n > "{count}"
if [[ $2 == stop ]]; then exit 0; fi
{body}
"""


def _fake_ray(tmp_path, monkeypatch, body: str) -> str:
    d = tmp_path / "fake-ray-agent-not-ready"
    d.mkdir()
    count = tmp_path / "count"
    script = d / "ray"
    script.write_text(SCRIPT.format(count=count, body=body))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(jobpairs.time, "sleep", lambda s: None)
    return str(count)


def test_a_refused_submission_is_made_again(tmp_path, monkeypatch, capsys):
    count = _fake_ray(tmp_path, monkeypatch, f"""if (( n < 3 )); then
  echo "RuntimeError: Request failed with status code 500: {jobpairs.AGENT_NOT_READY}, please try again later.."
  exit 1
fi
echo "Job 'x' succeeded"
exit 0""")
    assert jobpairs.submit("http://127.0.0.1:1", "x", ["--traces", "reuse"], timeout_s=60) == 0
    assert open(count).read().strip() == "3"
    assert "Job 'x' succeeded" in capsys.readouterr().out  # the job's output is passed on as it comes


def test_another_failure_is_not_retried(tmp_path, monkeypatch):
    count = _fake_ray(tmp_path, monkeypatch, 'echo "Job failed: bench.burst.pairs exited with 1"; exit 1')
    assert jobpairs.submit("http://127.0.0.1:1", "x", [], timeout_s=60) == 1
    assert open(count).read().strip() == "1"


def test_a_submission_past_its_time_is_stopped(tmp_path, monkeypatch):
    count = _fake_ray(tmp_path, monkeypatch, "sleep 30")
    assert jobpairs.submit("http://127.0.0.1:1", "x", [], timeout_s=2) == 124
    assert open(count).read().strip() == "2"  # the submission, then `ray job stop`


def _no_token(tmp_path, monkeypatch) -> str:
    for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    path = str(tmp_path / ".ray" / "auth_token")
    monkeypatch.setattr(jobpairs.ray_attach, "TOKEN_PATH", path)
    return path


def test_a_machine_without_a_token_gets_one_before_the_head_starts(tmp_path, monkeypatch):
    """The real `ray get-auth-token --generate`: Ray 2.60's `ray start --head` in token mode refuses to start
    without ~/.ray/auth_token, which a fresh GPU machine lacks (its first jobpairs call failed so)."""
    path = _no_token(tmp_path, monkeypatch)
    jobpairs.ensure_token()
    assert os.path.getsize(path) > 0


def test_an_existing_token_is_kept(tmp_path, monkeypatch):
    path = _no_token(tmp_path, monkeypatch)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("ours")
    count = _fake_ray(tmp_path, monkeypatch, "exit 1")
    jobpairs.ensure_token()
    assert open(path).read() == "ours" and not os.path.exists(count)  # `ray` was not called


def test_a_failed_token_generation_stops_the_run(tmp_path, monkeypatch):
    _no_token(tmp_path, monkeypatch)
    _fake_ray(tmp_path, monkeypatch, "echo cannot write; exit 1")
    with pytest.raises(jobpairs.subprocess.CalledProcessError) as e:
        jobpairs.ensure_token()
    assert e.value.cmd[:2] == ["ray", "get-auth-token"]
