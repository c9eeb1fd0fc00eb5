"""Clients we did not write, run unchanged against `flame-llm serve-http` (the tiny model on CPU, text through the
tiny tokenizer): `vllm bench serve` (vLLM's wheel unpacked without its dependencies: .ci/run puts it in
VLLM_BENCH_SITE) and guidellm (its own venv: it would downgrade aiohttp's multidict and click here; .ci/run makes
it). A short run each: zero failed requests by the client's own counters, and our /metrics counted as many
answered requests as the client completed."""
import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from bench.load.external_clients import GUIDELLM_VENV, run
from flame_llm.models.tokenizer import tokenizer_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_BENCH_SITE = os.environ.get("FLAME_VLLM_BENCH_SITE",
                                 os.path.join(os.path.expanduser("~"), ".cache", "flame_llm", "vllm-bench-site"))
NUM_PROMPTS = 8  # a short run: each client's start dominates its time; 8 answers still cross every counter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("door") / "serve-http.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "flame_llm.cli", "serve-http", "--model", "tiny", "--tokenizer",
                             "tiny", "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": REPO})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"serve-http exited early: {log.seek(0) or log.read()[-2000:]}"
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            break
        except OSError:
            assert time.monotonic() < deadline, "serve-http did not come up in 180 s"
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def _args(client: str, url: str, out: str) -> argparse.Namespace:
    return argparse.Namespace(client=[client], target=[url], model=None, tokenizer=tokenizer_dir("", "tiny"),
                              num_prompts=NUM_PROMPTS, input_len=32, output_len=8, rate=[20.0], seed=0,
                              vllm_site=VLLM_BENCH_SITE, guidellm=None, timeout_s=600.0, out=out)


def _check(records: list[dict]) -> None:
    (rec,) = records
    assert rec["failed"] == 0 and rec["completed"] == NUM_PROMPTS, rec
    assert rec["server_answered_200"] == rec["completed"], rec  # our /metrics agrees with the client's count
    assert rec["median_ttft_ms"] > 0 and rec["output_tok_per_s"] > 0, rec


@pytest.mark.skipif(not os.path.isdir(os.path.join(VLLM_BENCH_SITE, "vllm")),
                    reason=f"vLLM's bench client is not unpacked at {VLLM_BENCH_SITE} (.ci/run does it)")
def test_vllm_bench_serve(door, tmp_path):
    _check(run(_args("vllm", door, str(tmp_path))))


@pytest.mark.skipif(not os.path.exists(GUIDELLM_VENV), reason=f"no guidellm at {GUIDELLM_VENV} (.ci/run makes it)")
def test_guidellm(door, tmp_path):
    _check(run(_args("guidellm", door, str(tmp_path))))
