"""The suite runs in two parts (README's test command, .ci/run): two xdist workers for everything marked neither
`serial` nor `slow`, then the `serial` tests alone, since `flame-llm serve` refuses to start beside another Ray
cluster. The `slow` tests (long end-to-end runs) have a command of their own, named in the README beside it."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ('-n 2 --dist loadfile -m "not serial and not slow"', '-m "serial and not slow"')


def test_the_readme_and_ci_run_both_parts_and_the_readme_names_the_slow_tests_command():
    readme = open(os.path.join(REPO, "README.md")).read()
    line, slow = [x for x in readme.splitlines() if x.startswith("RAY_ADDRESS= python3 -m pytest tests")]
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    for part in PARTS:
        assert part in line and part in ci, part
    assert slow.endswith(" -m slow") and "-n " not in slow  # one process: a slow test may be serial too


def test_a_serial_test_on_an_xdist_worker_fails_saying_how_to_run_it():
    env = {**os.environ, "PYTEST_XDIST_WORKER": "gw7", "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-m", "pytest", "tests/test_cli.py::test_serve_submit_status_stop", "-q",
                          "-p", "no:cacheprovider", "-p", "no:xdist"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:]
    assert "is marked serial" in out.stdout and "pytest tests -m serial" in out.stdout, out.stdout[-2000:]
    assert "serve exited early" not in out.stdout  # failed before it started anything
