"""Issue 18 items 6-7: a stream whose shard dies after its first token goes on from its last token: the rule in
retry.decide, the continuation (flame_llm/serving/retry.py), and on a real local Ray with a one-shard tiny Llama
service: the stream waits for its shard's restart and resumes there with the tokens of an uninterrupted greedy run,
a death after the last token ends the stream with what it had (no resend), and the front door's SSE stream of a
resumed request is one stream with no duplicate. The two-shard service's cases are in test_stream_socket.py."""
import asyncio
import json
import math
import time
import urllib.request

import numpy as np
import pytest
import ray
from helpers import answering, service_with_a_client
from ray.exceptions import RayActorError

from flame_llm import SamplingParams
from flame_llm.models.tiny import TINY_VOCAB_SIZE
from flame_llm.protocol.errors import ErrorCode
from flame_llm.protocol.types import Request, prompt_digest
from flame_llm.serving.frontdoor import start_frontdoor, stop_frontdoor
from flame_llm.serving.http_app import HttpConfig
from flame_llm.serving.pending import Pending
from flame_llm.serving.retry import Action, continuation, decide, stream_end

NS = "test-stream-resume"
# every token id is an EOS id of this module's engine: a request that does not ignore EOS ends at its first token
# (test_a_death_after_an_eos_token...); every other request here ignores EOS
ENGINE = {"max_model_len": 512, "max_num_batched_tokens": 512, "max_num_seqs": 8, "cpu_kvcache_gib": 0.03125,
          "eos_token_ids": list(range(TINY_VOCAB_SIZE))}
LONG = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LOST = RayActorError()


# ---- the rule and the continuation (no Ray) ----

def _pending(attempts=0):
    loop = asyncio.new_event_loop()
    p = Pending(Request("r", np.zeros(3, dtype=np.uint32), SamplingParams()), [], 0.0, 0, loop.create_future(),
                attempts=attempts, deadline=math.inf)
    loop.close()
    return p


def test_a_lost_stream_is_restarted_within_max_retries():
    d = decide(_pending(), 3, lost=LOST, shard=1, streamed=True)
    assert d.action is Action.RESTART
    spent = decide(_pending(attempts=3), 3, lost=LOST, shard=1, streamed=True)
    assert spent.action is Action.FAIL and spent.error.code is ErrorCode.SHARD_DIED
    assert spent.error.message.startswith("shard 1 died while streaming this request, 4 times: RayActorError")
    # as for a request that streamed nothing
    assert decide(_pending(), 3, lost=LOST, shard=1).action is Action.RESTART
    assert decide(_pending(attempts=3), 3, lost=LOST, shard=1).action is Action.FAIL


def test_a_lost_stream_that_had_all_its_tokens_is_done_without_a_resend():
    d = decide(_pending(attempts=3), 3, lost=LOST, shard=0, streamed=True, complete="length")
    assert d.action is Action.DONE and d.finish_reason == "length"  # even with its retries spent: no resend


def test_the_continuation_appends_the_streamed_tokens_and_leaves_the_callers_request_alone():
    sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=10, stop_token_ids=[2, 3], seed=41)
    prompt = np.array([7, 8, 9], dtype=np.uint32)
    original = Request("x", prompt, sp)
    c = continuation(original, [11, 12, 13])
    assert c.id == "x" and c.prompt_token_ids.tolist() == [7, 8, 9, 11, 12, 13]
    assert c.sampling.max_tokens == 7 and c.sampling.seed == 44  # fresh sampler keys for the rest
    assert (c.sampling.temperature, c.sampling.top_k, c.sampling.top_p, c.sampling.stop_token_ids) == (0.7, 5, 0.9,
                                                                                                      (2, 3))
    assert original.prompt_token_ids is prompt and prompt.tolist() == [7, 8, 9] and sp.max_tokens == 10
    assert sp.seed == 41
    assert continuation(Request("y", [1], SamplingParams(max_tokens=3)), [5]).sampling.seed is None
    with pytest.raises(AssertionError):
        continuation(original, [1] * 10)  # nothing left to make


def test_stream_end_says_when_the_streamed_tokens_already_ended_the_request():
    original = Request("x", np.arange(10, dtype=np.uint32), SamplingParams(max_tokens=5, stop_token_ids=[99]))
    assert stream_end(original, [1, 2], max_model_len=100) is None
    assert stream_end(original, [1, 99], max_model_len=100) == "stop"
    assert stream_end(original, [1, 2, 3, 4, 5], max_model_len=100) == "length"
    assert stream_end(original, [1, 2], max_model_len=12) == "length"  # the sequence reached max_model_len
    # the model's EOS ids (published in each shard's health) end it too, unless the request ignores EOS
    assert stream_end(original, [1, 7], 100, eos_token_ids=frozenset({7})) == "stop"
    ignoring = Request("y", original.prompt_token_ids, SamplingParams(max_tokens=5, ignore_eos=True))
    assert stream_end(ignoring, [1, 7], 100, eos_token_ids=frozenset({7})) is None


# ---- a one-shard service on a real local Ray ----

@pytest.fixture(scope="module")
def service(tiny_llama):  # this module kills the shard often: restarts without limit
    yield from service_with_a_client(tiny_llama, ENGINE, 1, NS)


def _restarted(actor, old: str, timeout_s=120.0) -> None:
    """Wait until the actor answers as a new incarnation (a kill lands a moment after ray.kill returns)."""
    deadline = time.monotonic() + timeout_s
    while answering(actor).incarnation == old:
        assert time.monotonic() < deadline, "the shard did not restart"
        time.sleep(0.1)


def _prompt(seed, n=12):
    return np.random.default_rng(seed).integers(3, 512, size=n).tolist()


def test_a_stream_waits_for_its_restarted_shard_and_resumes_there(service):
    svc, client = service
    actor = svc.actors[0]
    prompt = _prompt(7)
    (want,) = client.generate([prompt], LONG)
    old = answering(actor).incarnation
    retries, resumes = client.counters.retries, client.counters.stream_resumes

    async def main():
        toks, chunks, t_kill = [], [], None
        async for chunk in client.stream_chunks(prompt, LONG):
            if chunk.token_ids and not toks:
                t_kill = time.time()
                ray.kill(actor, no_restart=False)
            toks += chunk.token_ids
            chunks.append(chunk)
        return toks, chunks[-1].result, t_kill

    toks, res, t_kill = asyncio.run(main())
    assert res.error is None, res
    assert toks == want.output_token_ids == res.output_token_ids  # none repeated, none skipped
    assert len(toks) == LONG.max_tokens and res.finish_reason == "length"
    assert res.timings["resumed"] == 1 and res.timings["attempts"] == 2
    assert res.prompt_tokens == len(prompt) and res.prompt_digest == prompt_digest(prompt)
    assert res.shard == 0 and res.device == "cpu-0"
    assert res.timings["arrived_at"] > res.timings["sent_at"] > t_kill  # the continuation's, sent after the kill
    _restarted(actor, old)
    assert client.counters.retries == retries + 1 and client.counters.stream_resumes == resumes + 1
    assert want.timings.get("resumed") is None  # a batch request is no stream


def _dies_before_the_result(channel, actors):
    """The channel's stream items, with the shard killed as its result arrives: the client sees the death after the
    stream's last token and before its result (the window a real death can hit)."""
    real = channel.stream_items

    async def items(payload):
        async for item in real(payload):
            if isinstance(item, bytes):
                ray.kill(actors[channel.shard], no_restart=False)
                raise RayActorError()
            yield item
    return items


@pytest.mark.parametrize("how", ["length", "stop", "eos"])
def test_a_death_after_the_last_token_ends_the_stream_with_what_it_had(service, monkeypatch, how):
    svc, client = service
    prompt = _prompt(5)
    sp = SHORT
    if how == "stop":
        (plain,) = client.generate([prompt], SHORT)
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[plain.output_token_ids[4]])
    if how == "eos":  # the model's EOS (every id, in this module's engine), which the client learns from health()
        assert answering(svc.actors[0]).eos_token_ids == tuple(range(TINY_VOCAB_SIZE))
        sp = SamplingParams(temperature=0.0, max_tokens=12)
    (want,) = client.generate([prompt], sp)
    if how == "eos":  # ended by its first token; before the client knew EOS ids it sent a continuation after it
        how = "stop"
        assert len(want.output_token_ids) == 1
    assert want.finish_reason == how
    old, retries = answering(svc.actors[0]).incarnation, client.counters.retries
    channel = client.dispatch.channels[0]
    monkeypatch.setattr(channel, "stream_items", _dies_before_the_result(channel, svc.actors))

    async def main():
        return [c async for c in client.stream_chunks(prompt, sp)]

    chunks = asyncio.run(main())
    res = chunks[-1].result
    assert res.error is None and res.finish_reason == how, res
    assert [t for c in chunks for t in c.token_ids] == want.output_token_ids == res.output_token_ids
    assert res.timings["resumed"] == 0 and res.timings["attempts"] == 1 and client.counters.retries == retries
    assert res.prompt_tokens == len(prompt) and res.prompt_digest == prompt_digest(prompt)
    _restarted(svc.actors[0], old)  # it did die


def test_the_front_doors_sse_stream_goes_on_after_the_shard_dies(service, tmp_path):
    svc, client = service
    answering(svc.actors[0])
    handle, url = start_frontdoor(NS, HttpConfig(port=0))
    try:
        prompt = _prompt(7)
        (want,) = client.generate([prompt], LONG)
        body = json.dumps({"model": "x", "prompt": prompt, "max_tokens": LONG.max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
        models = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=30).read())
        body = body.replace(b'"x"', json.dumps(models["data"][0]["id"]).encode())
        req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        events, killed = [], False
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if not killed and events[-1] != "[DONE]" and json.loads(events[-1])["choices"][0]["token_ids"]:
                    ray.kill(svc.actors[0], no_restart=False)
                    killed = True
        assert killed and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks[-3:]
        toks = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
        assert toks == want.output_token_ids  # one continuous stream, no duplicate
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "length" and finishes.count("length") == 1
        assert chunks[-1]["usage"]["prompt_tokens"] == len(prompt)
        assert chunks[-1]["usage"]["completion_tokens"] == LONG.max_tokens
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
        assert "flame_client_stream_resumes_total 1.0" in metrics  # the door's client resumed it once
    finally:
        del handle
        stop_frontdoor(NS)
        answering(svc.actors[0])
