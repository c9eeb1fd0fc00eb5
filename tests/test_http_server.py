"""The engine's OpenAI-style HTTP server, served for real on 127.0.0.1 and called over HTTP."""
import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from flame_llm import LLM, AsyncEngine, SamplingParams
from flame_llm.protocol.types import prompt_digest
from flame_llm.serving.http_server import build_app


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = AsyncEngine.from_args(tiny_llama, block_size=16, max_model_len=512, max_num_batched_tokens=512,
                                   cpu_kvcache_gib=0.01)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_app(engine, device_name="cpu-7", model_name="tiny"), access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", tiny_llama
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.run_until_complete(runner.cleanup())
    engine.shutdown()


def _call(url: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_token_id_completion_matches_the_offline_engine(server):
    url, model = server
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
    url, _ = server
    doc = [(7 * i) % 500 + 3 for i in range(48)]  # three full 16-token blocks, unseen by other tests
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    _, first = _call(f"{url}/v1/completions", {**body, "prompt": doc + [11, 12]})
    _, second = _call(f"{url}/v1/completions", {**body, "prompt": doc + [13, 14, 15]})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48


def test_a_list_of_prompts_gets_one_choice_each(server):
    url, _ = server
    status, out = _call(f"{url}/v1/completions", {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3,
                                                  "ignore_eos": True, "temperature": 0})
    assert status == 200
    assert [c["index"] for c in out["choices"]] == [0, 1] and all(len(c["token_ids"]) == 3 for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("body,param,words", [
    ({"max_tokens": 4}, "prompt", "field 'prompt' must be a non-empty list of token ids"),
    ({"prompt": [1, -2]}, "prompt", "field 'prompt'"),
    ({"prompt": [1, True, 3]}, "prompt", "field 'prompt' must be a non-empty list of token ids"),
    ({"prompt": [1, 2.5]}, "prompt", "field 'prompt' must be a non-empty list of token ids"),
    ({"prompt": [[1, 2], [3, False]]}, "prompt", "field 'prompt' must be a non-empty list of token ids"),
    ({"prompt": [[1, 2], "x", 3]}, "prompt", "field 'prompt'"),
    ({"prompt": [1, 100000]}, "prompt", "token id 100000 at position 1 is >= vocab_size 512"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens", "'max_tokens' must be an integer >= 1"),
    ({"prompt": [1, 2], "max_tokens": "8"}, "max_tokens", "'max_tokens' must be an integer >= 1"),
    ({"prompt": [1, 2], "temperature": -1}, "temperature", "'temperature' must be a number in [0, 100]"),
    ({"prompt": [1, 2], "stream": True}, "stream", "field 'stream' must be false"),
    ({"prompt": [1, 2], "n": 3}, "n", "field 'n' must be 1"),
    ({"prompt": [1, 2], "ignore_eos": "yes"}, "ignore_eos", "field 'ignore_eos' must be true or false"),
    ({"prompt": [1] * 600}, "prompt", "the limit is 511 (max_model_len 512"),
    ({"prompt": [1] * 512}, "prompt", "prompt has 512 tokens; the limit is 511"),
    ({"prompt": "some text"}, "prompt", "text prompts need a tokenizer"),
    ({"prompt": [1, 2], "top_p": 0}, "top_p", "'top_p' must be in (0, 1]"),
    ({"prompt": [1, 2], "max_tokens": True}, "max_tokens", "field 'max_tokens' must be a number, not True"),
    ({"prompt": [1, 2], "stop_token_ids": 5}, "stop_token_ids", "field 'stop_token_ids' must be a list of token ids"),
    (["not", "an", "object"], "body", "must be a JSON object"),
])
def test_bad_input_answers_400_naming_the_field(server, body, param, words):
    url, _ = server
    status, out = _call(f"{url}/v1/completions", body)
    assert status == 400, out
    assert out["error"]["param"] == param and words in out["error"]["message"], out
    assert out["error"]["type"] == "invalid_request_error"


def test_invalid_json_is_a_400_and_the_server_keeps_serving(server):
    url, _ = server
    status, out = _call(f"{url}/v1/completions", raw=b"{not json")
    assert status == 400 and out["error"]["param"] == "body"
    assert _call(f"{url}/v1/completions", {"prompt": [4, 5], "max_tokens": 2})[0] == 200


def test_health_and_models(server):
    url, model = server
    status, h = _call(f"{url}/health")
    assert status == 200 and h["status"] == "ok" and h["device"] == "cpu-7"
    assert h["vocab_size"] == 512 and h["model"] == model and "@" in h["model_revision"]
    assert (h["max_model_len"], h["max_prompt_tokens"]) == (512, 511)
    status, m = _call(f"{url}/v1/models")
    assert status == 200 and m["data"][0]["id"] == "tiny" and m["data"][0]["max_model_len"] == 512
