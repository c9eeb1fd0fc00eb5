"""engine_process behind both hosts that use it: the engine actor on a real local Ray (through the service's client:
batch and stream transports), and serve-http (its HTTP/SSE front door, text in and out: the tokenizer and the
outputs' text live in the parent). Outputs are checked against the offline engine (greedy)."""
import argparse
import asyncio
import json
import urllib.request

import numpy as np
import pytest
import ray
from helpers import service_with_a_client
from test_http_server import _serve

from flame_llm import LLM, SamplingParams
from flame_llm.engine.engine_process import ProcessEngine
from flame_llm.serving.http_app import HttpConfig
from flame_llm.serving.http_server import ARGUMENTS, EngineBackend, engine_fields

ENGINE = {"max_model_len": 512, "max_num_batched_tokens": 512, "max_num_seqs": 8, "cpu_kvcache_gib": 0.03125,
          "engine_process": True}
SP = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)


def test_serve_http_engine_process_flag_sets_the_engine_field():
    p = argparse.ArgumentParser()
    for flags, kwargs in ARGUMENTS:
        p.add_argument(*flags, **kwargs)
    assert engine_fields(p.parse_args(["--model", "tiny", "--engine-process"]))["engine_process"] is True
    assert "engine_process" not in engine_fields(p.parse_args(["--model", "tiny"]))


@pytest.fixture(scope="module")
def service(tiny_llama):
    yield from service_with_a_client(tiny_llama, ENGINE, 1, "test-engine-process")


def test_the_engine_actor_serves_batches_and_streams_from_its_engine_process(service, tiny_llama):
    svc, client = service
    actor = svc.actors[0]
    prompts = [np.random.default_rng(k).integers(3, 500, size=10 + k).tolist() for k in range(4)]
    fields = {k: v for k, v in ENGINE.items() if k != "engine_process"}
    want = LLM(tiny_llama, **fields).generate(prompts, SP, use_tqdm=False)
    got = client.generate(prompts, SP)
    assert [r.output_token_ids for r in got] == [w.output_token_ids for w in want]
    assert all(r.error is None and r.finish_reason == "length" for r in got)

    async def stream(prompt):
        toks, res = [], None
        async for chunk in client.stream_chunks(prompt, SP):
            toks += chunk.token_ids
            res = chunk.result or res
        return toks, res

    toks, res = asyncio.run(stream(prompts[2]))
    assert res.error is None and toks == want[2].output_token_ids
    ray.get(actor.debug_slow_engine.remote(0.0))  # forwarded to the engine process as a command
    stats = ray.get(actor.stats.remote())
    assert stats["engine_failed"] is False
    assert stats["engine"]["num_decode_tokens"] > 0 and stats["engine"]["num_in_flight"] == 0
    pid = ray.get(actor.__ray_call__.remote(lambda self: self.engine.pid))
    assert isinstance(pid, int) and pid != ray.get(actor.health.remote()).pid  # a process of its own


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_serve_http_over_an_engine_process_speaks_text(tmp_path_factory):
    from transformers import AutoTokenizer

    from flame_llm.config import Config
    from flame_llm.models.tiny import ensure_tiny_default

    model = ensure_tiny_default(str(tmp_path_factory.mktemp("default") / "tiny-llama"))
    fields = {"block_size": 16, "max_model_len": 512, "max_num_batched_tokens": 512, "cpu_kvcache_gib": 0.01}
    engine = ProcessEngine(Config.from_kwargs(model, engine_process=True, **fields))
    url, close = _serve(EngineBackend(engine, "cpu-0"), HttpConfig(port=0))
    try:
        body = {"model": "tiny-llama", "prompt": "The keeper climbed the steps", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        (choice,) = _post(url, body)["choices"]
        tok = AutoTokenizer.from_pretrained(model)
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        (want,) = LLM(model, **fields).generate([tok.encode(body["prompt"])], sp, use_tqdm=False)
        assert choice["token_ids"] == want.output_token_ids
        assert choice["text"] == tok.decode(choice["token_ids"], skip_special_tokens=True) and choice["text"]
    finally:
        close()
        engine.shutdown()
