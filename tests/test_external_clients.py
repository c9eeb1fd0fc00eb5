"""Clients we did not write, run unchanged against both front doors (the tiny model on CPU, text through the tiny
tokenizer): `flame-llm serve-http` (the engine alone) and `flame-llm serve` (local Ray, two engine actors, the
front door actor; serial tests). The clients: `vllm bench serve` (vLLM's wheel unpacked without its
dependencies: .ci/run puts it in VLLM_BENCH_SITE) and guidellm (its own venv: it would downgrade aiohttp's multidict
and click here; .ci/run makes it). A short run each: zero failed requests by the client's own counters, our /metrics
counted as many answered requests as the client completed, and nothing the client asked for was refused (vLLM's
client asks for /tokenize: a 404 there went unnoticed while it measured on)."""
import argparse
import json
import math
import os

import pytest
from servers import serve, serve_http

from bench.load.external_clients import (
    GUIDELLM_VENV,
    STEP_COUNTERS,
    FlameScrape,
    guidellm_argv,
    run,
    server_counts,
    server_steps,
    vllm_argv,
)
from flame_llm.models.tokenizer import tokenizer_dir

VLLM_BENCH_SITE = os.environ.get("FLAME_VLLM_BENCH_SITE",
                                 os.path.join(os.path.expanduser("~"), ".cache", "flame_llm", "vllm-bench-site"))
NUM_PROMPTS = 8  # a short run: each client's start dominates its time; 8 answers still cross every counter
HAS_VLLM = pytest.mark.skipif(not os.path.isdir(os.path.join(VLLM_BENCH_SITE, "vllm")),
                              reason=f"vLLM's bench client is not unpacked at {VLLM_BENCH_SITE} (.ci/run does it)")
HAS_GUIDELLM = pytest.mark.skipif(not os.path.exists(GUIDELLM_VENV),
                                  reason=f"no guidellm at {GUIDELLM_VENV} (.ci/run makes it)")
# `flame-llm serve` as small as the demo's: two CPU shards of the embedded tiny model, its text through the tiny BPE
SERVICE = {"model": "tiny", "tokenizer": "tiny",
           "engine": {"max_model_len": 512, "max_num_batched_tokens": 512, "cpu_kvcache_gib": 0.03125},
           "placement": {"num_shards": 2, "cpu_per_shard": 0.5}, "shard": {"torch_threads": 1},
           "ray": {"namespace": "external-clients", "num_cpus": 2}}


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("door") / "serve-http.log")
    with serve_http(["--model", "tiny", "--tokenizer", "tiny"], log) as url:
        yield url


@pytest.fixture(scope="module")
def service_door(tmp_path_factory):
    with serve(SERVICE, str(tmp_path_factory.mktemp("service"))) as url:
        yield url


def _args(client: str, url: str, out: str, rate: float = 20.0) -> argparse.Namespace:
    return argparse.Namespace(client=[client], target=[url], model=None, tokenizer=tokenizer_dir("", "tiny"),
                              num_prompts=NUM_PROMPTS, input_len=32, output_len=8, rate=[rate], seed=0,
                              max_concurrency=None, vllm_site=VLLM_BENCH_SITE, guidellm=None, timeout_s=600.0,
                              out=out)


def _check(records: list[dict], out: str) -> None:
    for rec in records:
        assert rec["failed"] == 0 and rec["completed"] == NUM_PROMPTS, rec
        assert rec["server_answered_200"] == rec["completed"], rec  # our /metrics agrees with the client's count
        assert rec["server_not_ok"] == {}, rec  # nothing the client asked for was refused (a missing route: a 404)
        assert rec["median_ttft_ms"] > 0 and rec["output_tok_per_s"] > 0, rec
        steps = rec["server_steps"]  # the engines' steps over the run, from /metrics (the timeline is CUDA's: 0 here)
        assert steps["decode_tokens"] >= rec["completed"] and steps["prefill_tokens"] > 0, steps
        assert steps["steps"] == steps["decode_steps"] + steps["prefill_steps"] > 0, steps
    with open(os.path.join(out, "summary.jsonl")) as f:  # strict JSON (rate inf too): jq reads it
        lines = f.read().splitlines()
    assert [json.loads(ln, parse_constant=lambda c: pytest.fail(f"{c} in summary.jsonl")) for ln in lines] == records


def _two_rates(client: str, door: str, out: str) -> None:
    """Two rates, each with prompts of its own: with one seed the second would replay prompts the prefix cache
    holds and the server would compute a few tokens of each (session 23's H100 run measured rates 16 and inf so)."""
    a = _args(client, door, out)
    a.rate, a.input_len = [20.0, 40.0], 300  # serve-http: 128-token blocks; a replay computes the last 44 tokens
    first, second = records = run(a)
    _check(records, out)
    assert (first["seed"], second["seed"]) == (0, 1)
    assert second["server_steps"]["prefill_tokens"] > 0.6 * first["server_steps"]["prefill_tokens"], (first, second)


@HAS_VLLM
def test_vllm_bench_serve(door, tmp_path):
    _two_rates("vllm", door, str(tmp_path))
    for log in tmp_path.glob("vllm-*/client.log"):
        assert "/tokenize unavailable" not in log.read_text()  # it checked its tokenizer against ours


@HAS_GUIDELLM
def test_guidellm(door, tmp_path):
    _two_rates("guidellm", door, str(tmp_path))


@pytest.mark.serial
@HAS_VLLM
def test_vllm_bench_serve_against_the_service(service_door, tmp_path):
    """Through Ray: front door actor, router, two shards; every request at once (rate inf)."""
    _check(run(_args("vllm", service_door, str(tmp_path), rate=math.inf)), str(tmp_path))
    (log,) = tmp_path.glob("vllm-*/client.log")
    assert "/tokenize unavailable" not in log.read_text()


@pytest.mark.serial
@HAS_GUIDELLM
def test_guidellm_against_the_service(service_door, tmp_path):
    """guidellm's throughput profile (rate inf) through the service."""
    _check(run(_args("guidellm", service_door, str(tmp_path), rate=math.inf)), str(tmp_path))


def test_rate_inf_is_guidellms_throughput_profile_with_a_concurrency():
    """guidellm 0.8.1 refuses its throughput profile without max_concurrency ("Field required"): at rate inf the
    harness gives it --max-concurrency, else every prompt at once (as vLLM's client sends at rate inf)."""
    a = _args("guidellm", "http://x", "/out")

    def profile(rate: float, **kw) -> str:
        argv = guidellm_argv(argparse.Namespace(**{**vars(a), **kw}), "http://x", "m", rate, "/out/g.json")
        return argv[argv.index("--profile") + 1]

    assert profile(math.inf) == f"kind=throughput,max_concurrency={NUM_PROMPTS}"
    assert profile(math.inf, max_concurrency=3) == "kind=throughput,max_concurrency=3"
    assert profile(20.0) == "kind=constant,rate=20"
    assert profile(2.5, max_concurrency=3) == "kind=constant,rate=2.5,max_concurrency=3"
    vllm = vllm_argv(a, "http://x", "m", math.inf, "/out")
    assert vllm[vllm.index("--request-rate") + 1] == "inf" and "--max-concurrency" not in vllm
    vllm = vllm_argv(argparse.Namespace(**{**vars(a), "max_concurrency": 3}), "http://x", "m", math.inf, "/out")
    assert vllm[vllm.index("--max-concurrency") + 1] == "3"


def test_server_counts_take_the_clients_answers_and_every_refusal():
    before = {("/v1/completions", "POST", "200"): 5, ("/metrics", "GET", "200"): 1}
    after = {("/v1/completions", "POST", "200"): 13, ("/metrics", "GET", "200"): 2, ("/health", "GET", "200"): 1,
             ("unmatched", "POST", "404"): 1, ("/v1/chat/completions", "POST", "400"): 2}
    assert server_counts(before, after) == {
        "server_answered_200": 8,
        "server_not_ok": {"POST /v1/chat/completions 400": 2, "POST unmatched 404": 1}}
    assert server_counts(None, after) == {"server_answered_200": None, "server_not_ok": None}  # not a flame server


def test_server_steps_are_the_counters_difference_with_the_gpus_share():
    zero = dict.fromkeys(STEP_COUNTERS, 0.0)
    before = FlameScrape({}, {**zero, "decode_steps": 10, "gpu_busy_seconds": 1.0, "timeline_steps": 10})
    after = FlameScrape({}, {**zero, "decode_steps": 30, "prefill_steps": 5, "gpu_busy_seconds": 1.3,
                             "gpu_idle_seconds": 0.1, "timeline_steps": 35})
    got = server_steps(before, after)["server_steps"]
    assert (got["steps"], got["decode_steps"], got["prefill_steps"]) == (25, 20, 5)
    assert got["gpu_ms_per_timed_step"] == pytest.approx(12.0) and got["gpu_idle_share"] == pytest.approx(0.25)
    assert server_steps(None, after) == {"server_steps": None}  # not a flame server
    assert server_steps(after, after)["server_steps"]["gpu_idle_share"] is None  # nothing timed (CPU)
