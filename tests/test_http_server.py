"""serve-http: the engine alone behind the front door's OpenAI code (flame_llm/serving/http_app.py), served for
real on 127.0.0.1 and called over HTTP and raw sockets (bounded in count and time)."""
import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from flame_llm import LLM, AsyncEngine, SamplingParams
from flame_llm.protocol.types import EngineLimits, prompt_digest
from flame_llm.serving import openai_api
from flame_llm.serving.http_app import HttpConfig, build_app, start
from flame_llm.serving.http_server import EngineBackend

KEY = "sesame"


def _serve(backend, cfg: HttpConfig, sock=None):
    """The door's app on a loop of its own: started as serve starts it, or on `sock` (a listening socket set up by
    the test, e.g. with a small send buffer)."""
    loop = asyncio.new_event_loop()
    if sock is None:
        runner, url = loop.run_until_complete(start(build_app(backend, cfg), cfg))
    else:
        runner = web.AppRunner(build_app(backend, cfg), handler_cancellation=True)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, sock).start())
        host, port = sock.getsockname()[:2]
        url = f"http://{host}:{port}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def close():
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
    return url, close


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = AsyncEngine.from_args(tiny_llama, block_size=16, max_model_len=512, max_num_batched_tokens=512,
                                   cpu_kvcache_gib=0.01)
    backend = EngineBackend(engine, "cpu-7", "tiny")
    url, close = _serve(backend, HttpConfig(port=0, max_prompts_per_request=4, header_timeout_s=1.0,
                                            body_timeout_s=1.0))
    keyed, close_keyed = _serve(backend, HttpConfig(port=0, api_key=KEY))
    yield url, tiny_llama, engine, keyed
    close()
    close_keyed()
    engine.shutdown()


def _call(url: str, body=None, raw: bytes | None = None, headers=None) -> tuple[int, dict]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_token_id_completion_matches_the_offline_engine(server):
    url, model, *_ = server
    prompt = list(range(3, 40))
    status, out = _call(f"{url}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True})
    assert status == 200, out
    ref = LLM(model, block_size=16, max_model_len=512, max_num_batched_tokens=512).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    (choice,) = out["choices"]
    assert choice["token_ids"] == ref.output_token_ids and len(choice["token_ids"]) == 12
    assert choice["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == len(prompt) and out["usage"]["completion_tokens"] == 12
    assert out["flame"]["prompt_digests"] == [prompt_digest(prompt)] and out["flame"]["device"] == "cpu-7"
    assert out["model"] == "tiny" and out["object"] == "text_completion"


def test_repeated_prefix_reports_cached_tokens(server):
    url, *_ = server
    doc = [(7 * i) % 500 + 3 for i in range(48)]  # three full 16-token blocks, unseen by other tests
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    _, first = _call(f"{url}/v1/completions", {**body, "prompt": doc + [11, 12]})
    _, second = _call(f"{url}/v1/completions", {**body, "prompt": doc + [13, 14, 15]})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48


def test_a_list_of_prompts_gets_one_choice_each(server):
    url, *_ = server
    status, out = _call(f"{url}/v1/completions", {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3,
                                                  "ignore_eos": True, "temperature": 0})
    assert status == 200
    assert [c["index"] for c in out["choices"]] == [0, 1] and all(len(c["token_ids"]) == 3 for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("body,param,words", [
    ({"max_tokens": 4}, "prompt", "field 'prompt' is required"),
    ({"prompt": []}, "prompt", "field 'prompt' must be a non-empty list of token ids"),
    ({"prompt": [1, -2]}, "prompt", "field 'prompt'"),
    ({"prompt": [1, True, 3]}, "prompt", "field 'prompt' must be a non-empty list of token ids"),
    ({"prompt": [1, 2.5]}, "prompt", "field 'prompt' must be a non-empty list of token ids"),
    ({"prompt": [[1, 2], [3, False]]}, "prompt", "field 'prompt' must be a non-empty list of token ids"),
    ({"prompt": [[1, 2], "x", 3]}, "prompt", "field 'prompt'"),
    ({"prompt": [1, 100000]}, "prompt", "token id 100000 at position 1 is >= vocab_size 512"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens", "'max_tokens' must be an integer >= 1"),
    ({"prompt": [1, 2], "max_tokens": "8"}, "max_tokens", "'max_tokens' must be an integer >= 1"),
    ({"prompt": [1, 2], "temperature": -1}, "temperature", "'temperature' must be a number in [0, 100]"),
    ({"prompt": [1, 2], "stream": "yes"}, "stream", "field 'stream' must be true or false"),
    ({"prompt": [1, 2], "n": 0}, "n", "field 'n' must be an integer >= 1"),
    ({"prompt": [1, 2], "max_tokens": 511}, "max_tokens", "at most 510 tokens can be generated"),
    ({"prompt": [1, 2], "stop": "x"}, "stop", "stop strings need a tokenizer"),
    ({"prompt": [1, 2], "logit_bias": {"5": 1}}, "logit_bias", "'logit_bias' is not supported"),
    ({"prompt": [1, 2], "ignore_eos": "yes"}, "ignore_eos", "field 'ignore_eos' must be true or false"),
    ({"prompt": [1] * 600}, "prompt", "the limit is 511 (max_model_len 512"),
    ({"prompt": [1] * 512}, "prompt", "prompt has 512 tokens; the limit is 511"),
    ({"prompt": "some text"}, "prompt", "text prompts need a tokenizer"),
    ({"prompt": [1, 2], "top_p": 0}, "top_p", "'top_p' must be in (0, 1]"),
    ({"prompt": [1, 2], "max_tokens": True}, "max_tokens", "field 'max_tokens' must be a number, not True"),
    ({"prompt": [1, 2], "stop_token_ids": 5}, "stop_token_ids", "field 'stop_token_ids' must be a list of token ids"),
    (["not", "an", "object"], "body", "must be a JSON object"),
    # a token id past int64 was an HTTP 500 OverflowError (np.fromiter into int64)
    ({"prompt": [1, 2 ** 70]}, "prompt", "token id 1180591620717411303424 at position 1 is >= vocab_size 512"),
    ({"prompt": [[1, 2], [2 ** 64, 3]]}, "prompt", "token id 18446744073709551616 at position 0 is >= vocab_size"),
    ({"prompt": [1, 2], "stop_token_ids": [2 ** 70]}, "stop_token_ids", "'stop_token_ids'"),
    ({"prompt": [1, 2], "seed": 2 ** 70}, "seed", "'seed'"),
    # OpenAI's `stop` is strings; ids have their own field, and the message says which
    ({"prompt": [1, 2], "stop": [475]}, "stop", "(stop token ids go in stop_token_ids)"),
    ({"prompt": [1, 2], "user": 7}, "user", "field 'user' must be a string of at most 256 characters"),
    ({"prompt": [1, 2], "user": "u" * 257}, "user", "field 'user' must be a string of at most 256 characters"),
])
def test_bad_input_answers_400_naming_the_field(server, body, param, words):
    url, *_ = server
    status, out = _call(f"{url}/v1/completions", body)
    assert status == 400, out
    assert out["error"]["param"] == param and words in out["error"]["message"], out
    assert out["error"]["type"] == "invalid_request_error"
    assert isinstance(out["error"]["code"], str) and out["error"]["code"], out  # one type: OpenAI's are strings


def test_every_error_code_is_a_string(server):
    """HTTP errors of every kind (the server's own, a field's, a prompt's, the engine's limit, a route's) carry a
    string `code`: it was the int status in most and a string in others."""
    url, *_ = server
    cases = [(f"{url}/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, 400, "bad_sampling"),
             (f"{url}/v1/completions", {"prompt": [1, 600]}, 400, "token_out_of_range"),
             (f"{url}/v1/completions", {"prompt": [1, 2], "max_tokens": 511}, 400, "context_length_exceeded"),
             (f"{url}/v1/completions", {"prompt": [1, 2], "model": "gpt-4"}, 404, "model_not_found"),
             (f"{url}/v1/completions", {"prompt": [[1, 2]] * 5}, 413, "request_too_large"),
             (f"{url}/v1/nothing", {}, 404, "not_found"),
             (f"{url}/v1/completions", None, 405, "method_not_allowed"),
             (f"{url}/v1/completions", {"prompt": "text"}, 400, "invalid_request")]
    for where, body, status, code in cases:
        got, out = _call(where, body)
        assert (got, out["error"]["code"]) == (status, code), (where, body, out)


def test_metrics_count_http_requests_by_route_and_status(server):
    url, *_ = server

    def samples() -> dict:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            fams = list(text_string_to_metric_families(r.read().decode()))
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples
                if s.name.startswith("flame_http_")}

    def count(before: dict, after: dict, route: str, status: str, method: str = "POST") -> float:
        key = ("flame_http_requests_total", (("method", method), ("route", route), ("status", status)))
        return after.get(key, 0) - before.get(key, 0)

    before = samples()
    assert _call(f"{url}/v1/completions", {"prompt": [4, 5], "max_tokens": 2})[0] == 200
    assert _call(f"{url}/v1/completions", {"prompt": [4, 5], "max_tokens": 0})[0] == 400
    assert _call(f"{url}/v1/completions", {"prompt": [4, 5], "max_tokens": 0})[0] == 400
    assert _call(f"{url}/no/such/route/{time.time()}", {})[0] == 404
    assert _call(f"{url}/v1/models")[0] == 200
    after = samples()
    assert count(before, after, "/v1/completions", "200") == 1
    assert count(before, after, "/v1/completions", "400") == 2
    assert count(before, after, "unmatched", "404") == 1  # a made-up path adds no label value of its own
    assert count(before, after, "/v1/models", "200", "GET") == 1
    key = ("flame_http_request_duration_seconds_count", (("route", "/v1/completions"),))
    assert after[key] - before.get(key, 0) == 3
    inf = ("flame_http_request_duration_seconds_bucket", (("le", "+Inf"), ("route", "/v1/completions")))
    assert after[inf] == after[key]


def test_invalid_json_is_a_400_and_the_server_keeps_serving(server):
    url, *_ = server
    status, out = _call(f"{url}/v1/completions", raw=b"{not json")
    assert status == 400 and out["error"]["param"] == "body"
    assert _call(f"{url}/v1/completions", {"prompt": [4, 5], "max_tokens": 2})[0] == 200


def test_health_and_models(server):
    url, model, *_ = server
    status, h = _call(f"{url}/health")
    assert status == 200 and h["status"] == "ok" and h["device"] == "cpu-7"
    assert h["vocab_size"] == 512 and h["model"] == model and "@" in h["model_revision"]
    assert (h["max_model_len"], h["max_prompt_tokens"]) == (512, 511)
    status, m = _call(f"{url}/v1/models")
    assert status == 200 and m["data"][0]["id"] == "tiny" and m["data"][0]["max_model_len"] == 512


def _sse(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = r.read().decode().splitlines()
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_stream_equals_the_whole_response_and_the_first_token_comes_first(server):
    url, *_ = server
    body = {"prompt": [[21, 22, 23], [24, 25]], "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    status, whole = _call(f"{url}/v1/completions", body)
    assert status == 200
    chunks = _sse(url, {**body, "stream_options": {"include_usage": True}})
    for k in (0, 1):
        ids = [t for c in chunks for ch in c["choices"] if ch["index"] == k for t in ch["token_ids"]]
        assert ids == whole["choices"][k]["token_ids"]
    assert chunks[-1]["usage"]["completion_tokens"] == 14 and chunks[-1]["choices"] == []


def test_api_key_limits_chat_without_tokenizer_and_metrics(server):
    url, _, engine, keyed = server
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    status, out = _call(f"{keyed}/v1/completions", body)
    assert status == 401 and out["error"]["code"] == "invalid_api_key"
    assert _call(f"{keyed}/v1/completions", body, headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    assert _call(f"{keyed}/health")[0] == 200  # health stays open
    status, out = _call(f"{url}/v1/completions", {"prompt": [[1, 2]] * 5})
    assert status == 413 and "the limit is 4 per request" in out["error"]["message"]
    status, out = _call(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "need a tokenizer" in out["error"]["message"]
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        fams = {f.name for f in text_string_to_metric_families(r.read().decode())}
    assert {"flame_shard_queue_depth", "flame_shard_kv_usage_ratio", "flame_shard_requests"} <= fams


def test_a_model_without_a_chat_template_is_a_clear_400():
    class NoTemplate:
        chat_template = None

    with pytest.raises(openai_api.ApiError, match="has no chat template") as e:
        openai_api.parse("chat", {"messages": [{"role": "user", "content": "hi"}]}, EngineLimits.of(512, 512),
                         openai_api.RequestLimits(8, 4096), NoTemplate())
    assert e.value.status == 400 and e.value.param == "messages"


def test_deep_json_and_a_short_body_over_raw_sockets(server):
    url, *_ = server
    host, port = url[len("http://"):].split(":")
    deep = b"[" * 100_000 + b"]" * 100_000
    status, out = _call(f"{url}/v1/completions", raw=deep)
    assert status == 400 and "nested too deeply" in out["error"]["message"]
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"prompt\"")
        assert s.recv(4096).startswith(b"HTTP/1.1 408")
    assert time.monotonic() - t0 < 5.0


def test_a_disconnected_client_aborts_its_requests_in_the_engine(server):
    url, _, engine, _ = server
    host, port = url[len("http://"):].split(":")
    for stream in (True, False):
        body = json.dumps({"prompt": [[31, 32, k] for k in range(3)], "max_tokens": 480, "ignore_eos": True,
                           "stream": stream}).encode()
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 30
        while engine.stats()["num_in_flight"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        s.close()
        deadline = time.monotonic() + 5
        while engine.stats()["num_in_flight"]:
            assert time.monotonic() < deadline, "the engine still serves the abandoned requests"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    """serve-http over the embedded default as `flame-llm serve-http --model tiny` builds it: with its tokenizer."""
    from flame_llm.models.tiny import ensure_tiny_default

    model = ensure_tiny_default(str(tmp_path_factory.mktemp("default") / "tiny-llama"))
    engine = AsyncEngine.from_args(model, block_size=16, max_model_len=512, max_num_batched_tokens=512,
                                   cpu_kvcache_gib=0.01)
    url, close = _serve(EngineBackend(engine, "cpu-0"), HttpConfig(port=0))
    yield url, model
    close()
    engine.shutdown()


def test_the_default_model_speaks_text_and_chat_through_the_openai_client(text_server):
    """The two calls OpenAI users try first: text in, text out; chat messages in, an assistant message out. The
    default model had no tokenizer: both were a 400."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    url, model = text_server
    tok = AutoTokenizer.from_pretrained(model)
    oa = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in oa.models.list().data] == ["tiny-llama"]
    out = oa.completions.create(model="tiny-llama", prompt="The keeper climbed the steps", max_tokens=8,
                                temperature=0, extra_body={"ignore_eos": True})
    (choice,) = out.choices
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 8 and isinstance(choice.text, str) and choice.text
    assert choice.text == tok.decode(ids, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(tok.encode("The keeper climbed the steps"))
    streamed = oa.completions.create(model="tiny-llama", prompt="The keeper climbed the steps", max_tokens=8,
                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where is the lamp?"}]
    chat = oa.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    reply = chat.choices[0]
    assert reply.message.role == "assistant" and isinstance(reply.message.content, str)
    assert reply.message.content == tok.decode(reply.model_extra["token_ids"], skip_special_tokens=True)
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want if isinstance(want, list) else want["input_ids"]
    assert chat.usage.prompt_tokens == len(want) and chat.usage.completion_tokens == 6
    stop = choice.text[3:5]
    assert len(stop) == 2
    stopped = oa.completions.create(model="tiny-llama", prompt="The keeper climbed the steps", max_tokens=8,
                                    temperature=0, stop=stop, extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == choice.text[:choice.text.find(stop)]  # stop strings work on the text
    assert stopped.choices[0].finish_reason == "stop"


def test_http_error_codes_are_the_protocols_where_it_has_one():
    """One spelling per error: a 400 with nothing more specific is the protocol's INVALID_REQUEST, and a failed
    result answers 503 (retryable), 400 (the request's fault) or 500 with its ErrorCode's value as the code."""
    from flame_llm.protocol.errors import ErrorCode
    from flame_llm.serving.openai_api import STATUS_CODES, ApiError, result_error

    assert ApiError(400, "x").code == STATUS_CODES[400] == ErrorCode.INVALID_REQUEST.value
    faults = {ErrorCode.BAD_REQUEST, ErrorCode.BAD_PROMPT, ErrorCode.EMPTY_PROMPT, ErrorCode.TOKEN_OUT_OF_RANGE,
              ErrorCode.PROMPT_TOO_LONG, ErrorCode.BAD_SAMPLING, ErrorCode.INVALID_REQUEST, ErrorCode.OVER_BUDGET}
    for code in ErrorCode:
        e = result_error({"error": {"code": code.value, "message": "m"}})
        assert e.status == (503 if code.retryable else 400 if code in faults else 500), code
        assert e.code == code.value and e.kind == ("invalid_request_error" if e.status == 400 else "server_error")


def test_engine_metrics_carry_what_can_stall_a_shard(server):
    """serve-http's /metrics (and the service's, through the same collector) export the engine's stall counters:
    kernels compiled after startup, GC pauses over 10 ms, and steps with prefill tokens replayed from graphs."""
    from flame_llm.serving.metrics import render_engine

    text = render_engine({"device": "cpu"}, {"jit_compiles": 3, "gc_pauses_over_10ms": 2, "mixed_graph_steps": 5},
                         {"requests": 1}).decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert (got["flame_shard_jit_compiles_total"], got["flame_shard_gc_pauses_over_10ms_total"],
            got["flame_shard_mixed_graph_steps_total"]) == (3, 2, 5)
    url, *_ = server
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        live = {s.name: s.value for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}
    assert live["flame_shard_jit_compiles_total"] == 0 and "flame_shard_gc_pauses_over_10ms_total" in live


def test_fields_external_clients_send():
    """vLLM's benchmark client sends repetition_penalty 1.0; guidellm and vLLM's clients may ask for usage on every
    chunk (stream_options.continuous_usage_stats). Other values are 400s naming the field."""
    parse = lambda body: openai_api.parse("completion", {"prompt": [1, 2], **body}, EngineLimits.of(512, 512),  # noqa: E731
                                          openai_api.RequestLimits(8, 4096))
    assert parse({"repetition_penalty": 1.0}).sampling[0].max_tokens == 16
    req = parse({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert req.include_usage and req.continuous_usage and not parse({"stream": True}).continuous_usage
    for body, param in (({"repetition_penalty": 1.1}, "repetition_penalty"),
                        ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options")):
        with pytest.raises(openai_api.ApiError) as e:
            parse(body)
        assert e.value.param == param and e.value.status == 400
