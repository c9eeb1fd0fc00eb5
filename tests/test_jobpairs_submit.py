"""bench.jobpairs.submit's answer to a Ray head that refuses a submission while its job agent registers ("No
available agent to submit job", seen once in CI right after the job API answered): the submission is made again.
That race cannot be forced on a real head, so these tests put a stand-in `ray` first on PATH (fake-ray-*/ray: it
says what a refusing head makes `ray job submit` say, then accepts); the real path is tests/test_pairs_report.py's
test_one_traces_pairs_through_ray_job_submit."""
import os
import stat

from bench import jobpairs

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
    count = _fake_ray(tmp_path, monkeypatch, 'echo "Job failed: bench.pairs exited with 1"; exit 1')
    assert jobpairs.submit("http://127.0.0.1:1", "x", [], timeout_s=60) == 1
    assert open(count).read().strip() == "1"


def test_a_submission_past_its_time_is_stopped(tmp_path, monkeypatch):
    count = _fake_ray(tmp_path, monkeypatch, "sleep 30")
    assert jobpairs.submit("http://127.0.0.1:1", "x", [], timeout_s=2) == 124
    assert open(count).read().strip() == "2"  # the submission, then `ray job stop`
