"""The README's examples run as written, so a renamed model, field or command fails here instead of a newcomer.

Every fenced block of README.md is either marked for CI (its info string: `bash ci`, `python ci`, `bash ci-serve`,
`bash ci-stop`) or preceded by an HTML comment `<!-- not run in CI: why -->`. The marked blocks run in document
order from the repository root, as a newcomer pastes them: `ci-serve` starts in the background (the test waits
for its "serving" line), `ci` blocks run to completion (bash with -euo pipefail and curl failing on an HTTP
error; python as a script), `ci-stop` stops the service and the serve process must then exit.
The blocks from `ci-serve` to `ci-stop` run in one test, marked serial (serve refuses to start beside another Ray
cluster on the machine); the blocks outside them (the offline engine, the quick benchmark) in another, marked
slow, which runs beside other tests.

Ports and clusters: the README says 127.0.0.1:8000 and lets every command find "the" Ray on the machine. To run
beside anything else there (other tests, other Ray clusters), the test picks a free port P, starts serve with
`--http-port P`, rewrites `:8000` to `:P` in every block, and runs the blocks between ci-serve and ci-stop with
RAY_ADDRESS set to the address serve prints (what `auto` finds on a machine with one cluster); nothing else is
changed."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
MARKS = {"ci", "ci-serve", "ci-stop"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)
SKIP_NOTE = re.compile(r"<!-- not run in CI: [^>]+ -->\s*$")
BLOCK_TIMEOUT_S = 600


def blocks() -> list[tuple[str, str, str, int]]:
    """(language, mark, code, line) of every fenced block; AssertionError for a block neither marked nor excused."""
    text = open(README).read()
    out = []
    for m in FENCE.finditer(text):
        info, code = m.group(1).split(), m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        lang, mark = (info + [""])[0], " ".join(info[1:])
        if mark not in MARKS:
            assert not mark, f"README.md:{line}: unknown mark {mark!r} (use one of {sorted(MARKS)})"
            assert SKIP_NOTE.search(text[:m.start()]), \
                f"README.md:{line}: a ```{lang} block neither marked for CI nor preceded by <!-- not run in CI: why -->"
        out.append((lang, mark, code, line))
    return out


def test_every_block_is_marked_or_excused():
    found = blocks()
    marked = [b for b in found if b[1]]
    assert [b[1] for b in marked].count("ci-serve") == 1 and [b[1] for b in marked].count("ci-stop") == 1
    assert all(lang in ("bash", "python") for lang, mark, _, _ in marked)
    assert len(marked) >= 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])
    if shutil.which("flame-llm") is None:  # not installed: the module the installed command runs
        env["PATH"] = _shim_dir() + os.pathsep + env["PATH"]
    return env


def _shim_dir() -> str:
    d = os.path.join(REPO, "out", "readme-shim")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "flame-llm"), "w") as f:
        f.write(f"#!/bin/sh\nexec {sys.executable} -m flame_llm.cli \"$@\"\n")
    os.chmod(os.path.join(d, "flame-llm"), 0o755)
    return d


def _run(lang: str, code: str, line: int, env: dict) -> str:
    """The block's stdout; AssertionError naming the README line when it fails."""
    if lang == "bash":  # curl answers an HTTP error with a failure, as `set -e` then stops the block
        argv = ["bash", "-euo", "pipefail", "-c", "curl() { command curl --fail-with-body \"$@\"; }\n" + code]
    else:
        argv = [sys.executable, "-c", code]
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    if out.returncode != 0:
        raise AssertionError(f"README.md:{line}: the ```{lang} block failed (rc {out.returncode}):\n{code}\n"
                             f"--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}")
    return out.stdout


def _wait_for_no_local_ray(timeout_s: float = 600.0) -> None:
    """`flame-llm serve` as the README writes it refuses to start beside another Ray cluster on this machine (one
    service, one local Ray): wait for one that another process runs to end, or skip saying so."""
    from flame_llm.serving.ray_attach import running_local_address

    deadline = time.monotonic() + timeout_s
    while (address := running_local_address()) is not None:
        if time.monotonic() > deadline:
            if os.environ.get("CI"):  # CI runs one suite on its own machine: a cluster left there is a defect
                pytest.fail(f"a Ray cluster ({address}) still runs on this machine after {timeout_s:.0f}s")
            pytest.skip(f"another process's Ray cluster ({address}) runs on this machine for {timeout_s:.0f}s; "
                        "flame-llm serve (as the README writes it) refuses to start beside it")
        time.sleep(5)


def _in_service(found: list[tuple[str, str, str, int]]) -> list[bool]:
    """Per block: whether it runs against the service (from its ci-serve block to its ci-stop block)."""
    inside, out = False, []
    for _, mark, _, _ in found:
        inside = inside or mark == "ci-serve"
        out.append(inside)
        inside = inside and mark != "ci-stop"
    return out


def test_the_service_blocks_are_told_apart_from_the_others():
    found = [("bash", "ci", "", 1), ("bash", "ci-serve", "", 2), ("bash", "ci", "", 3), ("bash", "ci-stop", "", 4),
             ("python", "ci", "", 5)]
    assert _in_service(found) == [False, True, True, True, False]
    real = blocks()
    flags = _in_service(real)
    assert {f for (_, mark, _, _), f in zip(real, flags) if mark} == {True, False}  # marked blocks of both kinds


@pytest.mark.slow
def test_readme_blocks_outside_the_service_run_as_written():
    """The blocks before `ci-serve` and after `ci-stop` (the offline engine, the quick benchmark: two fresh runs,
    about two minutes on 2 cores, hence slow): they start no `flame-llm serve`, so they run beside other tests."""
    env, outputs = _env(), {}
    found = blocks()
    try:
        for (lang, mark, code, line), inside in zip(found, _in_service(found)):
            if mark and not inside:
                outputs[line] = _run(lang, code, line, env)
    finally:
        shutil.rmtree(os.path.join(REPO, "out", "bench-quick"), ignore_errors=True)
    assert len(outputs) >= 2 and "| flame / engine |" in "\n".join(outputs.values())  # bench-quick's report


@pytest.mark.serial
def test_readme_service_blocks_run_as_written():
    """From `ci-serve` to `ci-stop`, in document order, against the one service they start and stop."""
    _wait_for_no_local_ray()
    port = _free_port()
    env = _env()
    serve, outputs = None, {}
    found = blocks()
    try:
        for (lang, mark, code, line), inside in zip(found, _in_service(found)):
            if not mark or not inside:
                continue
            code = code.replace(":8000", f":{port}")
            if mark == "ci-serve":
                cmd = code.split("#")[0].strip() + f" --http-port {port}"
                serve = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
                lines, deadline = [], time.monotonic() + 300
                while time.monotonic() < deadline:
                    got = serve.stdout.readline()
                    assert got, f"README.md:{line}: serve exited early:\n{''.join(lines)[-3000:]}"
                    lines.append(got)
                    if got.startswith("serving"):
                        break
                assert any(f"listening on http://127.0.0.1:{port}" in x for x in lines), lines
                (address,) = [x.rsplit("ray address:", 1)[1].strip() for x in lines if "ray address:" in x]
                env = {**env, "RAY_ADDRESS": address}
                continue
            outputs[line] = _run(lang, code, line, env)
            if mark == "ci-stop":
                assert serve is not None, "ci-stop before ci-serve"
                serve.wait(timeout=60)  # stop ends the serve process and its local Ray
                assert serve.returncode == 0
                serve, env = None, _env()
        assert serve is None, "the README starts a service it never stops"
        joined = "\n".join(outputs.values())
        assert "16/16 ok" in joined  # flame-llm submit
        assert 'flame_http_requests_total{method="POST",route="/v1/completions",status="200"}' in joined
    finally:
        if serve is not None and serve.poll() is None:
            os.killpg(serve.pid, signal.SIGTERM)
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
