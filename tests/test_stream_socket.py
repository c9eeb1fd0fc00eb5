"""Issue 18 item 2: streams over a direct socket to the shard (the one stream transport since issue 38 retired the
Ray streaming generator): the same tokens as the batch path, a cancelled stream or a closed connection aborted on
its shard, a connection without the shard's token refused, and a shard that dies under a stream handled by the
one retry policy (resumed from its last token). Real local Ray, real tiny Llama shards, real TCP; the
raw-connection tests speak the framing of flame_llm/protocol/stream_frames.py."""
import asyncio
import time

import numpy as np
import pytest
import ray
from helpers import answering, service_with_a_client, submitted

from flame_llm import SamplingParams
from flame_llm.protocol.stream_frames import Frame, StreamEndpoint, encode_frame, read_frame
from flame_llm.protocol.types import Request
from flame_llm.protocol.wire import decode_results, encode_requests
from flame_llm.serving.client import Client

ENGINE = {"max_model_len": 512, "max_num_batched_tokens": 512, "max_num_seqs": 8, "cpu_kvcache_gib": 0.03125}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def service(tiny_llama):  # this module kills shards four times: restarts without limit
    yield from service_with_a_client(tiny_llama, ENGINE, 2, "test-stream-socket")


def _prompts(n, length, seed, prefix=None):
    rng = np.random.default_rng(seed)
    return [(prefix or []) + rng.integers(3, 512, size=length).tolist() for _ in range(n)]


async def _chunks(client, prompt, sp):
    return [c async for c in client.stream_chunks(prompt, sp)]


def _tokens_and_result(chunks):
    return [t for c in chunks for t in c.token_ids], chunks[-1].result


def _stats(svc):
    return [ray.get(a.stats.remote()) for a in svc.actors.values()]


def _wait(cond, timeout_s=30.0, what=""):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _idle(svc):
    return all(s["inflight_requests"] == 0 and s["queued"] == 0 and s["engine"]["num_in_flight"] == 0
               for s in _stats(svc))


def test_socket_streams_equal_the_batch_path(service):
    svc, client = service
    prompts = _prompts(6, 20, seed=1)
    before = sum(s.get("socket_streams", 0) for s in _stats(svc))

    async def streams():
        return await asyncio.gather(*(_chunks(client, p, GREEDY) for p in prompts))

    got = asyncio.run(streams())
    batch = client.generate(prompts, GREEDY)
    want = [r.output_token_ids for r in batch]
    toks, results = zip(*(_tokens_and_result(cs) for cs in got))
    assert list(toks) == want
    assert [r.error for r in results] == [None] * 6 and [r.output_token_ids for r in results] == want
    assert all(r.finish_reason == "length" and r.timings["attempts"] == 1 for r in results)
    assert all({"arrived_at", "first_chunk_at", "sent_at", "first_chunk_at_client"} <= r.timings.keys()
               for r in results)
    assert sum(s.get("socket_streams", 0) for s in _stats(svc)) - before == 6  # over TCP
    conns = client.dispatch.conns
    assert conns and all(c.broken is None for c in conns.values())  # one persistent connection per shard used
    assert client_conn_count(svc) == len(conns)


def client_conn_count(svc):
    return sum(s.get("socket_connections", 0) for s in _stats(svc))


def test_a_cancelled_stream_is_aborted_on_its_shard(service):
    """A stream its reader leaves mid-way is aborted on its shard (a socket CANCEL frame) and counted there once, in
    the shard's "aborted" (what the metrics export)."""
    svc, client = service
    cancels = sum(s.get("socket_cancels", 0) for s in _stats(svc))
    done = sum(s["requests"] for s in _stats(svc))  # requests served to their end
    aborted = sum(s["aborted"] for s in _stats(svc))

    async def left_early(prompt):
        async for chunk in client.stream_chunks(prompt, LONG):
            if chunk.token_ids:
                return chunk.token_ids

    got = asyncio.run(left_early(_prompts(1, 16, seed=2)[0]))
    assert got
    _wait(lambda: _idle(svc), what="the cancelled stream still runs on its shard")
    assert sum(s.get("socket_cancels", 0) for s in _stats(svc)) - cancels == 1
    assert sum(s["requests"] for s in _stats(svc)) == done  # aborted, not run to its 400 tokens
    assert sum(s["aborted"] for s in _stats(svc)) - aborted == 1
    _wait(lambda: all(s["outstanding_work"] == 0 for s in ray.get(svc.router.stats.remote())["shards"]),
          what="the router still counts the cancelled stream's work")


def test_a_stream_closed_before_its_result_is_aborted_on_its_shard(service):
    """The socket transport's item generator closed (aclose) after a token but before its result, without a
    cancel: the shard is told to abort it (it once sent CANCEL only on CancelledError, so a close left the shard
    making the stream's 400 tokens for nobody)."""
    svc, client = service
    done = sum(s["requests"] for s in _stats(svc))
    aborted = sum(s["aborted"] for s in _stats(svc))
    d = client.dispatch
    payload = _payload(svc, "closed-early", _prompts(1, 16, seed=3)[0], LONG)

    async def close_early():
        items = d.channels[0].stream_items(payload)
        first = await items.__anext__()
        await items.aclose()
        return first

    first = asyncio.run_coroutine_threadsafe(close_early(), client._loop).result(timeout=60)
    assert isinstance(first, list) and first
    _wait(lambda: _idle(svc), what="the closed stream still runs on its shard")
    assert sum(s["requests"] for s in _stats(svc)) == done  # aborted, not run to its 400 tokens
    assert sum(s["aborted"] for s in _stats(svc)) - aborted == 1


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """What the peer sent before it closed the connection (a close with our frames unread resets it)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout=30)
    except ConnectionResetError:
        return b""


async def _raw(endpoint: StreamEndpoint, token: str):
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    writer.write(encode_frame(Frame.HELLO, token))
    return reader, writer


def _payload(svc, rid, prompt, sp):
    return encode_requests([Request(rid, np.asarray(prompt, dtype=np.uint32), sp)], svc.health[0].model_revision)


def test_a_connection_without_the_token_is_refused(service):
    svc, _ = service
    actor = svc.actors[1]
    ep = ray.get(actor.stream_endpoint.remote())
    assert ray.get(actor.stream_endpoint.remote()) == ep  # one server per incarnation
    refused, streams = (_stats(svc)[1].get(k, 0) for k in ("socket_refused", "socket_streams"))

    async def attempt(first: bytes):
        reader, writer = await asyncio.open_connection(ep.host, ep.port)
        writer.write(first)
        writer.write(encode_frame(Frame.OPEN, 0, _payload(svc, "sneak", [5, 6, 7], GREEDY), None, None))
        await writer.drain()
        got = await _closed(reader)  # the shard closes it: nothing sent
        writer.close()
        return got

    assert asyncio.run(attempt(encode_frame(Frame.HELLO, "0" * len(ep.token)))) == b""
    assert asyncio.run(attempt(encode_frame(Frame.HELLO, 12345))) == b""
    assert asyncio.run(attempt(encode_frame(Frame.OPEN, 0, b"", None, None))) == b""  # no hello at all
    after = _stats(svc)[1]
    assert after["socket_refused"] - refused == 3 and after["socket_streams"] == streams


def test_a_connection_closed_by_the_client_aborts_its_streams(service):
    svc, _ = service
    actor = svc.actors[0]
    ep = ray.get(actor.stream_endpoint.remote())
    dropped, done, aborted = (_stats(svc)[0].get(k, 0) for k in ("socket_dropped", "requests", "aborted"))

    async def main():
        reader, writer = await _raw(ep, ep.token)
        for sid in (0, 1):
            writer.write(encode_frame(Frame.OPEN, sid, _payload(svc, f"raw-{sid}", _prompts(1, 10, seed=3 + sid)[0],
                                                                 LONG), None, "raw"))
        first = {}
        while len(first) < 2:
            kind, sid, item = await asyncio.wait_for(read_frame(reader, 1 << 20), timeout=60)
            assert kind == Frame.CHUNK and isinstance(item, list)
            first.setdefault(sid, item)
        writer.close()  # the caller is gone

    asyncio.run(main())
    _wait(lambda: _stats(svc)[0].get("socket_dropped", 0) - dropped == 2, what="the shard missed the connection's end")
    _wait(lambda: _idle(svc), what="the streams of a closed connection still run on their shard")
    assert _stats(svc)[0]["requests"] == done  # aborted, not run to their 400 tokens
    assert _stats(svc)[0]["aborted"] - aborted == 2  # a gone connection's streams count as aborts


def test_a_raw_stream_ends_with_the_result_payload_of_the_batch_path(service):
    """The socket carries token lists, then the result payload (wire codec) a batch of one gets."""
    svc, _ = service
    actor = svc.actors[0]
    ep = ray.get(actor.stream_endpoint.remote())
    prompt = _prompts(1, 10, seed=5)[0]
    (a,) = submitted(actor, _payload(svc, "r1", prompt, GREEDY))

    async def main():
        reader, writer = await _raw(ep, ep.token)
        writer.write(encode_frame(Frame.OPEN, 7, _payload(svc, "r2", prompt, GREEDY), None, None))
        items = []
        while True:
            kind, sid, item = await asyncio.wait_for(read_frame(reader, 1 << 20), timeout=60)
            assert sid == 7
            items.append(item)
            if kind == Frame.RESULT:
                writer.close()
                return items

    via_socket = asyncio.run(main())
    (b,) = decode_results(via_socket[-1])
    assert [t for x in via_socket[:-1] for t in x] == a.output_token_ids
    assert b.output_token_ids == a.output_token_ids and (a.id, b.id) == ("r1", "r2")


def test_a_shard_dying_before_the_first_token_is_retried_after_its_restart(service):
    """The stream's shard fails its next engine step (and exits) before the stream's first token: the stream is
    sent again once the shard is back (or to the other one) and completes."""
    svc, client = service
    doc = _prompts(1, 300, seed=16)[0]  # a full KV block: the router knows its shard
    (first,) = client.generate([doc + [1]], GREEDY)
    shard = first.shard
    old = ray.get(svc.actors[shard].health.remote())
    ray.get(svc.actors[shard].debug_break_engine.remote())
    toks, res = _tokens_and_result(asyncio.run(_chunks(client, doc + [2, 3], GREEDY)))
    assert res.error is None and res.timings["attempts"] >= 2, res
    (want,) = client.generate([doc + [2, 3]], GREEDY)
    assert toks == want.output_token_ids == res.output_token_ids
    assert answering(svc.actors[shard]).incarnation != old.incarnation
    if res.shard == shard:  # the new incarnation's server, over a new connection
        assert client.dispatch.conns[shard].endpoint.incarnation != old.incarnation
    _wait(lambda: _idle(svc), what="work left on the shards")


def _died_after_first_token(svc, client):
    async def main():
        toks, victim = [], None
        async for chunk in client.stream_chunks(_prompts(1, 12, seed=20)[0], LONG):
            if chunk.token_ids and victim is None:
                (victim,) = [s for s, a in svc.actors.items() if ray.get(a.stats.remote())["inflight_requests"]]
                ray.kill(svc.actors[victim], no_restart=False)
            toks += chunk.token_ids
            if chunk.result is not None:
                return toks, chunk.result, victim

    toks, res, victim = asyncio.run(main())
    answering(svc.actors[victim])  # restarted before the next test
    return toks, res, victim


def test_a_shard_dying_after_the_first_token_resumes_the_stream(service):
    """The stream goes on from its last token once its shard is back (or on the other shard), with the tokens of
    an uninterrupted run and none repeated."""
    svc, client = service
    (want,) = client.generate(_prompts(1, 12, seed=20), LONG)
    toks, res, victim = _died_after_first_token(svc, client)
    assert res.error is None and res.finish_reason == "length", res
    assert toks == res.output_token_ids == want.output_token_ids
    assert res.timings["resumed"] == 1 and res.timings["attempts"] == 2 and res.prompt_tokens == 12
    _wait(lambda: _idle(svc), what="work left on the shards")
    _wait(lambda: all(s["outstanding_work"] == 0 for s in ray.get(svc.router.stats.remote())["shards"]),
          what="the router still counts the resumed stream's work")


def test_a_shard_that_dies_idle_is_routed_around_at_once_not_waited_for(service):
    """No request in flight when shard k dies: the client's idle stream connection to it ends, so the client
    knows at once and new streams go to the other shard while k restarts (on the retired Ray path, and before, a
    stream whose prefix lived on k waited out k's restart: 4.2 s in the CPU shard-kill run of 2026-12-02)."""
    svc, client = service
    doc = _prompts(1, 300, seed=30)[0]  # a full KV block: its shard is remembered
    (first,) = client.generate([doc + [1]], GREEDY)
    victim = first.shard
    asyncio.run(_chunks(client, doc + [2], GREEDY))  # the stream connection to the victim now exists
    assert victim in client.dispatch.conns
    ray.kill(svc.actors[victim], no_restart=False)
    _wait(lambda: victim in client.dispatch.shards.restarting, timeout_s=10.0,
          what="the client did not notice its shard's connection end")
    t0 = time.monotonic()
    toks, res = _tokens_and_result(asyncio.run(_chunks(client, doc + [3], GREEDY)))
    took = time.monotonic() - t0
    assert res.error is None and res.shard != victim and len(toks) == GREEDY.max_tokens, res
    restarted = answering(svc.actors[victim])
    assert took < 5.0 and restarted.restarted  # served by the other shard, not after the restart
    _wait(lambda: victim not in client.dispatch.shards.restarting, timeout_s=30.0, what="still restarting")
    _wait(lambda: _idle(svc), what="work left on the shards")


def test_a_batch_only_client_sees_an_idle_shard_die_and_routes_its_batches_around_it(service):
    """A client keeps a connection to every shard from its start, streams or not: a shard that
    dies with nothing in flight is seen at once, and a batch whose prefix lived there goes to the other shard
    while it restarts; after the restart the client is connected to the new incarnation again."""
    svc, _ = service
    client = Client.for_service(svc)
    try:
        _wait(lambda: len(client.dispatch.conns) == len(svc.actors), timeout_s=30.0,
              what="the client did not connect to every shard at its start")
        doc = _prompts(1, 300, seed=40)[0]
        (first,) = client.generate([doc + [1]], GREEDY)
        victim = first.shard
        old = client.dispatch.conns[victim].endpoint.incarnation
        ray.kill(svc.actors[victim], no_restart=False)
        _wait(lambda: victim in client.dispatch.shards.restarting, timeout_s=10.0,
              what="the client did not notice its idle shard die")
        t0 = time.monotonic()
        (again,) = client.generate([doc + [2]], GREEDY)
        assert again.error is None and again.shard != victim and time.monotonic() - t0 < 5.0, again
        assert answering(svc.actors[victim]).incarnation != old
        _wait(lambda: victim in client.dispatch.conns
              and client.dispatch.conns[victim].broken is None
              and client.dispatch.conns[victim].endpoint.incarnation != old, timeout_s=30.0,
              what="the client did not reconnect to the restarted shard")
    finally:
        client.close()
    _wait(lambda: _idle(svc), what="work left on the shards")
