"""Issue 37 on a real one-shard service (local Ray, tiny Llama, real TCP): request ids are keyed by their sender
inside the engine actor (a second stream connection sending a victim's in-flight id touches neither the victim's
request nor its cancel; a duplicate from one sender is refused before it registers, naming the field), the stream
port is on loopback for a client on the shard's node, and a shard whose serving loop is wedged reports unhealthy,
is restarted by the supervisor, and the stream it had finishes (resumed on its next incarnation)."""
import asyncio
import threading
import time

import numpy as np
import pytest
import ray
from helpers import answering, service_with_a_client
from test_stream_socket import _payload, _raw

from flame_llm import SamplingParams
from flame_llm.protocol.stream_frames import Frame, encode_frame, read_frame
from flame_llm.protocol.wire import decode_results
from flame_llm.serving.frontdoor import ClientBackend

ENGINE = {"max_model_len": 512, "max_num_batched_tokens": 512, "max_num_seqs": 8, "cpu_kvcache_gib": 0.03125}
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def service(tiny_llama):
    yield from service_with_a_client(tiny_llama, ENGINE, 1, "test-stream-owners")


def _prompt(seed, n=12):
    return np.random.default_rng(seed).integers(3, 512, size=n).tolist()


def _open(svc, sid, rid, prompt, sp):
    return encode_frame(Frame.OPEN, sid, _payload(svc, rid, prompt, sp), "job", "cl")


def _stats(svc):
    return ray.get(svc.actors[0].stats.remote())


async def _until_result(reader, sid):
    """The frames of stream sid up to its result: (token ids, its Result)."""
    tokens = []
    while True:
        kind, got, item = await asyncio.wait_for(read_frame(reader, 1 << 22), timeout=60)
        if got != sid:
            continue
        if kind == Frame.CHUNK:
            tokens += item
        else:
            assert kind == Frame.RESULT, item
            return tokens, decode_results(item)[0]


async def _first_chunk(reader, sid):
    while True:
        kind, got, item = await asyncio.wait_for(read_frame(reader, 1 << 22), timeout=60)
        if got == sid and kind == Frame.CHUNK:
            return item


def test_a_second_connection_cannot_touch_a_victims_request_and_a_duplicate_is_refused(service):
    svc, _ = service
    ep = ray.get(svc.actors[0].stream_endpoint.remote(ray.get_runtime_context().get_node_id()))
    aborted = _stats(svc)["aborted"]

    async def main():
        victim = await _raw(ep, ep.token)
        other = await _raw(ep, ep.token)
        victim[1].write(_open(svc, 0, "v1", _prompt(1), LONG))
        await _first_chunk(victim[0], 0)
        other[1].write(_open(svc, 5, "v1", _prompt(2), SHORT))  # the victim's id, from another connection
        tokens, res = await _until_result(other[0], 5)
        assert res.error is None and len(tokens) == 4 and res.id == "v1"
        victim[1].write(_open(svc, 1, "v1", _prompt(3), SHORT))  # the victim's own id again: refused
        tokens, dup = await _until_result(victim[0], 1)
        assert tokens == [] and dup.error.code == "duplicate_id" and "field 'id'" in dup.error.message
        victim[1].write(encode_frame(Frame.CANCEL, 0))  # the victim's cancel still reaches its request
        await victim[1].drain()
        await asyncio.sleep(0.5)  # the connections stay open while the shard is watched
        for _, w in (victim, other):
            w.close()

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while _stats(svc)["aborted"] - aborted < 1 or _stats(svc)["engine"]["num_in_flight"]:
        assert time.monotonic() < deadline, "the victim's cancel did not stop its request"
        time.sleep(0.05)
    assert _stats(svc)["requests"] >= 1




def test_the_stream_port_is_on_loopback_for_a_client_on_the_shards_node(service):
    svc, _ = service
    actor = svc.actors[0]
    here = ray.get_runtime_context().get_node_id()
    assert ray.get(actor.stream_endpoint.remote(here)).host == "127.0.0.1"
    assert ray.get(actor.stream_endpoint.remote()).host == "127.0.0.1"  # unnamed, on a one-node cluster
    far = ray.get(actor.stream_endpoint.remote("f" * 56))  # a client on another node: the node's address
    assert far.host == ray.util.get_node_ip_address() and far.host != "127.0.0.1"
    assert far.token == ray.get(actor.stream_endpoint.remote(here)).token


def test_a_wedged_shard_reports_unhealthy_and_is_restarted_with_its_stream_finished(service):
    svc, client = service
    actor = svc.actors[0]
    assert svc.replace_unhealthy_shards(probe_timeout_s=1.0) == [] and 0 in svc.judged
    before = answering(actor).incarnation
    prompt = _prompt(7, 20)
    sp = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    want = client.generate([prompt], sp)[0].output_token_ids
    got: dict = {}
    first = threading.Event()

    async def stream():
        chunks = []
        async for c in client.stream_chunks(prompt, sp):
            chunks.append(c)
            first.set()
        got["tokens"] = [t for c in chunks for t in c.token_ids]
        got["result"] = chunks[-1].result

    t = threading.Thread(target=lambda: asyncio.run(stream()))
    t.start()
    assert first.wait(60)
    actor.debug_block_loop.remote(120.0)  # the serving loop blocks, as a wedged one does
    time.sleep(0.5)
    live = ray.get(actor.live.remote(0.5), timeout=30)
    assert not live.ok and live.loop_lag_s is None and "wedged" in live.why and live.fds > 0
    door = asyncio.run(ClientBackend(client).health())  # the front door's /health: the wedged shard is not up
    assert door["shards"] == 1 and door["shards_up"] == 0 and door["status"] == "unavailable"
    restarted = []
    for _ in range(3):
        restarted += svc.replace_unhealthy_shards(probe_timeout_s=1.0)
        if restarted:
            break
    assert restarted == [0]
    deadline = time.monotonic() + 120
    while answering(actor).incarnation == before:  # the kill lands a moment after ray.kill returns
        assert time.monotonic() < deadline, "the shard was not restarted"
        time.sleep(0.2)
    t.join(120)
    assert not t.is_alive() and got["result"].error is None
    assert got["tokens"] == want and got["result"].output_token_ids == want
    assert ray.get(actor.live.remote(1.0)).ok
