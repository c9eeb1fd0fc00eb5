"""The service's HTTP front door on a real local Ray: two CPU shards of a tiny model with the embedded default's
tokenizer and chat template, the front door actor holding a Client, called by the real `openai` package, by curl
and by raw sockets (127.0.0.1 only, bounded in count and time). One service for the module."""
import asyncio
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from flame_llm import SamplingParams
from flame_llm.models.tiny import TINY_VOCAB_SIZE
from flame_llm.models.tiny_tokenizer import save_tokenizer
from flame_llm.serving.client import Client
from flame_llm.serving.frontdoor import start_frontdoor, stop_frontdoor
from flame_llm.serving.http_app import HttpConfig
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ServiceConfig

NS = "test-frontdoor"
ENGINE = {"max_model_len": 512, "max_num_batched_tokens": 512, "max_num_seqs": 16, "cpu_kvcache_gib": 0.03125}
HTTP = HttpConfig(port=0, max_prompts_per_request=8, max_tokens_per_request=2048, max_body_bytes=65536,
                  header_timeout_s=1.0, body_timeout_s=1.0)


@pytest.fixture(scope="module")
def door(tiny_llama, tmp_path_factory):
    model = str(tmp_path_factory.mktemp("chat") / "tiny-chat")
    shutil.copytree(tiny_llama, model)
    save_tokenizer(model, TINY_VOCAB_SIZE)  # the embedded default's tokenizer and chat template
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    svc = start_service(ServiceConfig.from_kwargs(model=model, engine=ENGINE, num_shards=2, cpu_per_shard=0.5,
                                                  namespace=NS, policy="cumulative"))
    handle, url = start_frontdoor(NS, HTTP)  # kept: the actor lives while a handle does
    yield url, svc
    del handle
    stop_frontdoor(NS)
    svc.stop(timeout_s=10)
    ray.shutdown()


def _call(url: str, body=None, method: str | None = None, headers=None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _inflight(svc) -> int:
    return sum(ray.get(a.stats.remote())["inflight_requests"] + ray.get(a.stats.remote())["queued"]
               for a in svc.actors.values())


def _wait_idle(svc, timeout_s: float) -> float:
    t0 = time.monotonic()
    while _inflight(svc):
        assert time.monotonic() - t0 < timeout_s, "the shards still serve abandoned requests"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_openai_package_completions_chat_and_streams(door):
    from openai import BadRequestError, OpenAI

    url, _ = door
    oa = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    (model,) = [m.id for m in oa.models.list().data]
    assert model == "tiny-chat"
    ids = oa.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0)
    assert ids.choices[0].finish_reason in ("length", "stop") and ids.usage.prompt_tokens == 4
    text = oa.completions.create(model=model, prompt=["hello world", "the quick"], max_tokens=8, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert [c.index for c in text.choices] == [0, 1] and all(c.finish_reason == "length" for c in text.choices)
    assert text.usage.completion_tokens == 16
    streamed = oa.completions.create(model=model, prompt="hello world", max_tokens=8, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    chunks = [c for c in streamed]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    parts = list(oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.choices[0].message.content
    assert parts[-1].usage.completion_tokens == 5
    seeded = oa.completions.create(model=model, prompt="hello", max_tokens=6, temperature=1.0, seed=7, n=2)
    assert len(seeded.choices) == 2
    with pytest.raises(BadRequestError, match="'logprobs' is not supported"):
        oa.completions.create(model=model, prompt="hello", max_tokens=2, logprobs=2)


def test_curl_streams_server_sent_events(door):
    url, _ = door
    body = json.dumps({"model": "tiny-chat", "prompt": [9, 10, 11], "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    out = subprocess.run(["curl", "-sN", "--max-time", "60", "-H", "Content-Type: application/json", "-d", body,
                          f"{url}/v1/completions"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    events = [line[len("data: "):] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 6
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_ends_the_text_and_aborts_the_engine_request(door):
    url, svc = door
    base = {"model": "tiny-chat", "prompt": "the lazy dog", "temperature": 0, "ignore_eos": True}
    status, full = _call(f"{url}/v1/completions", {**base, "max_tokens": 40})
    assert status == 200
    text = full["choices"][0]["text"]
    stop = text[len(text) // 3:len(text) // 3 + 2]  # greedy: the same text again, cut before this
    assert stop.strip(), text
    for stream in (False, True):
        t0 = time.monotonic()
        if stream:
            out = subprocess.run(["curl", "-sN", "--max-time", "60", "-H", "Content-Type: application/json", "-d",
                                  json.dumps({**base, "max_tokens": 400, "stop": [stop], "stream": True}),
                                  f"{url}/v1/completions"], capture_output=True, text=True, timeout=90)
            chunks = [json.loads(line[6:]) for line in out.stdout.splitlines()
                      if line.startswith("data: {")]
            got = "".join(c["choices"][0]["text"] for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            status, out = _call(f"{url}/v1/completions", {**base, "max_tokens": 400, "stop": stop})
            assert status == 200, out
            got, finish = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
        assert got == text[:text.index(stop)] and finish == "stop"
        _wait_idle(svc, 5.0)  # the engine stopped at the match, not after 400 tokens
        assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("body, status, param, words", [
    ({"prompt": [[1, 2]] * 9}, 413, "prompt", "the limit is 8 per request (max_prompts_per_request)"),
    ({"prompt": [1, 2], "n": 9}, 413, "prompt", "x n=9"),
    ({"prompt": [[1, 2]] * 5, "max_tokens": 500}, 413, "max_tokens", "(max_tokens_per_request)"),
    ({"prompt": [1, 2], "max_tokens": 600}, 400, "max_tokens", "maximum context length is 512 tokens"),
    ({"prompt": [1, 2], "frobnicate": 1}, 400, "frobnicate", "unrecognized field(s) ['frobnicate']"),
    ({"prompt": [1, 2], "echo": True}, 400, "echo", "'echo' is not supported"),
    ({"prompt": [1, 2], "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ({"prompt": [1, 2], "model": "gpt-4"}, 404, "model", "does not exist"),
    ({"prompt": [1, 2], "stop": [""]}, 400, "stop", "field 'stop' must be"),
    ({"prompt": [1, 2], "stream_options": {"include_usage": True}}, 400, "stream_options", "with stream: true"),
])
def test_limits_and_unsupported_fields_answer_with_openai_errors(door, body, status, param, words):
    url, _ = door
    got, out = _call(f"{url}/v1/completions", body)
    assert got == status, out
    assert out["error"]["param"] == param and words in out["error"]["message"], out
    assert isinstance(out["error"]["code"], str), out  # one type everywhere (it was the int status in most)


def test_routes_methods_and_chat_errors(door):
    url, _ = door
    status, out = _call(f"{url}/v2/nothing")
    assert status == 404 and out["error"]["message"] == "no route /v2/nothing"
    status, out = _call(f"{url}/v1/completions", method="GET")
    assert status == 405 and "method GET is not allowed" in out["error"]["message"]
    status, out = _call(f"{url}/v1/chat/completions", {"messages": [{"role": "user"}]})
    assert status == 400 and out["error"]["param"] == "messages"
    status, h = _call(f"{url}/health")
    assert status == 200 and h["shards_up"] == 2 and h["max_model_len"] == 512


def test_metrics_cover_the_service(door):
    url, _ = door
    _call(f"{url}/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 2})
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as r:
        text = r.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("flame_shard_queue_depth", "flame_shard_admitted", "flame_shard_rejected",
                 "flame_shard_running_sequences", "flame_shard_waiting_sequences", "flame_shard_kv_usage_ratio",
                 "flame_shard_prefix_hit_ratio", "flame_router_decisions", "flame_shard_batch_requests",
                 "flame_shard_payload_bytes", "flame_shard_ttft_seconds", "flame_shard_tpot_seconds",
                 "flame_shard_request_seconds", "flame_http_e2e_seconds", "flame_http_ttft_seconds",
                 "flame_client_payload_bytes"):
        assert name in fams, sorted(fams)
    decisions = {s.labels["decision"] for s in fams["flame_router_decisions"].samples}
    assert {"sticky", "new", "spill"} <= decisions
    kinds = {"raw": 0.0, "wire": 0.0}  # summed over the shards (the request went to one of them)
    for sample in fams["flame_shard_payload_bytes"].samples:
        kinds[sample.labels["kind"]] += sample.value
    assert kinds["raw"] > 0 and kinds["wire"] > 0
    counts = [s.value for s in fams["flame_http_e2e_seconds"].samples if s.name.endswith("_count")]
    assert counts and counts[0] >= 1
    ok = [s.value for s in fams["flame_http_requests"].samples if s.name == "flame_http_requests_total"
          and s.labels == {"route": "/v1/completions", "method": "POST", "status": "200"}]
    assert ok and ok[0] >= 1  # HTTP requests by route and status, and their latency
    assert "flame_http_request_duration_seconds" in fams


def test_python_client_text_prompt_returns_text(door):
    """`client.generate(["text"], ...)` on the default's tokenizer: the result carries the decoded text."""
    from transformers import AutoTokenizer

    _, svc = door
    client = Client.for_service(svc)
    try:
        (r,) = client.generate(["The keeper climbed the steps"], SamplingParams(temperature=0.0, max_tokens=8,
                                                                               ignore_eos=True))
        r = r.to_dict()
        tok = AutoTokenizer.from_pretrained(client.model_dir)
        assert r["error"] is None and len(r["output_token_ids"]) == 8
        assert r["prompt_tokens"] == len(tok.encode("The keeper climbed the steps"))
        assert isinstance(r["text"], str) and r["text"] == tok.decode(r["output_token_ids"])
    finally:
        client.close()


def test_a_disconnected_client_aborts_its_requests(door):
    """A client that goes away mid-request (streamed or not) aborts its requests on the engines: a following
    request is not delayed by the abandoned ones."""
    url, svc = door
    host, port = url[len("http://"):].split(":")
    for stream in (True, False):
        body = json.dumps({"prompt": [[7, 8, 9, k] for k in range(4)], "max_tokens": 500, "ignore_eos": True,
                           "stream": stream}).encode()
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 30
        while _inflight(svc) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        s.close()
        took = _wait_idle(svc, 5.0)
        t0 = time.monotonic()
        status, _ = _call(f"{url}/v1/completions", {"prompt": [4, 5, 6], "max_tokens": 4})
        assert status == 200 and time.monotonic() - t0 < 5.0, took


def _raw(host: str, port: int, data: bytes, read_timeout: float = 10.0) -> tuple[bytes, float]:
    """Send raw bytes, read until the server closes or answers; (what came back, seconds)."""
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=read_timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and b'"error"' in out:
                    break
        except TimeoutError:
            pass
    return out, time.monotonic() - t0


def test_hardening_timeouts_sizes_and_nesting(door):
    url, _ = door
    host, port = url[len("http://"):].split(":")
    port = int(port)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    # a Content-Length larger than the body: a 408 after body_timeout_s, not a connection held for 20 s
    out, took = _raw(host, port, head + b"Content-Length: 1000\r\n\r\n{\"prompt\": [1]")
    assert out.startswith(b"HTTP/1.1 408") and took < 5.0, out[:200]
    # a Content-Length over max_body_bytes: 413 before the body is sent
    out, took = _raw(host, port, head + b"Content-Length: 10000000\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413") and b"max_body_bytes is 65536" in out and took < 5.0
    # JSON nested 30,000 deep (the 100,000-deep case is serve-http's test; this door's body limit is 64 KiB)
    deep = b"[" * 30_000 + b"]" * 30_000
    out, _ = _raw(host, port, head + b"Content-Length: %d\r\n\r\n" % len(deep) + deep)
    assert out.startswith(b"HTTP/1.1 400") and b"nested too deeply" in out, out[:300]
    # 200 connections with half-sent heads are all closed within header_timeout_s (1 s here)
    socks = []
    try:
        for _ in range(200):
            s = socket.create_connection((host, port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            socks.append(s)
        t0 = time.monotonic()
        for s in socks:
            s.settimeout(max(0.1, 10 - (time.monotonic() - t0)))
            assert s.recv(1024) == b""  # closed by the server
        assert time.monotonic() - t0 < 8.0
    finally:
        for s in socks:
            s.close()
    assert _call(f"{url}/v1/completions", {"prompt": [4, 5], "max_tokens": 2})[0] == 200


def test_stream_from_python_client_first_token_and_cancel(door):
    """The Python client's stream: tokens as sampled, equal to the batch API's; a caller that stops reading
    aborts the request on its shard."""
    _, svc = door
    client = Client.for_service(svc)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        (want,) = client.generate([[11, 12, 13]], sp)

        async def main():
            got = [t async for t in client.stream([11, 12, 13], sp)]
            long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
            async for _ in client.stream([14, 15, 16], long):
                break
            return got

        assert asyncio.run(main()) == want.output_token_ids
        _wait_idle(svc, 5.0)
        assert sum(ray.get(a.stats.remote())["aborted"] for a in svc.actors.values()) >= 1
    finally:
        client.close()


def test_a_port_in_use_is_one_line(door):
    from aiohttp import web

    from flame_llm.serving.http_app import start

    url, _ = door
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(RuntimeError, match=rf"cannot listen on 127.0.0.1:{port}: .*--http-port"):
        asyncio.run(start(web.Application(), HttpConfig(port=port)))
