"""A request the client sends again never fails because of the attempt before it (session 7's H200 shard-kill run,
bench/results/2026-12-02d-h200-session7/load-kill: 2 of 180 streams failed with `invalid_request: ValueError:
request_id '...' is already in flight`). There the restart wait's health probe heard the restarted shard only after
streams had connected to it, and the client dropped that connection as the dead incarnation's: the shard aborted
their attempts, but its engine thread, busy in a step, had not taken the aborts up when the client's resends came
with the same ids. Now each send after the first goes under its own id (pending.attempt_id), and a connection to
the incarnation that answers is kept (ShardChannel.drop_conn). Real local Ray, a one-shard tiny Llama service, real TCP;
the engine's pause after each step (EngineActor.debug_slow_engine) stands in for a long GPU step."""
import asyncio
import time

import numpy as np
import pytest
import ray
from helpers import service_with_a_client

from flame_llm import SamplingParams
from flame_llm.protocol.types import EngineLimits, Request
from flame_llm.protocol.wire import decode_requests
from flame_llm.serving.pending import ClientCodec, ClientCounters, Pending, attempt_id

NS = "test-resend-ids"
ENGINE = {"max_model_len": 512, "max_num_batched_tokens": 512, "max_num_seqs": 8, "cpu_kvcache_gib": 0.03125}
SP = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PAUSE_S = 0.5  # the engine thread's pause after each step: far longer than the client takes to send again


def test_each_send_after_the_first_goes_under_its_own_id():
    loop = asyncio.new_event_loop()
    try:
        p = Pending(Request("c-7", np.arange(3, 9, dtype=np.uint32), SP), [], 0.0, 0, loop.create_future())
        codec = ClientCodec("rev", 1, ClientCounters())
        ids = []
        for attempts in (0, 1, 2):
            p.attempts = attempts
            ids.append(attempt_id(p))
            (sent,) = decode_requests(codec.encode([p]), EngineLimits.of(1000, 512, 1 << 20)).items
            assert sent.id == ids[-1]
        assert ids == ["c-7", "c-7~1", "c-7~2"] and p.request.id == "c-7"  # the caller's request is untouched
    finally:
        loop.close()


@pytest.fixture(scope="module")
def service(tiny_llama):
    yield from service_with_a_client(tiny_llama, ENGINE, 1, NS)


def _prompt(seed, n=12):
    return np.random.default_rng(seed).integers(3, 512, size=n).tolist()


def _wait(cond, timeout_s=30.0, what=""):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _idle(actor) -> bool:
    s = ray.get(actor.stats.remote())
    e = s["engine"]
    return (s["inflight_requests"] == 0 and s["queued"] == 0 and e["num_in_flight"] == 0
            and e["num_free_blocks"] == e["num_blocks"])  # no attempt left running, no KV block held


def _stream(client, prompt, on_first_token):
    async def main():
        toks, res = [], None
        async for chunk in client.stream_chunks(prompt, SP):
            if chunk.token_ids and not toks:
                on_first_token()
            toks += chunk.token_ids
            res = chunk.result or res
        return toks, res
    return asyncio.run(main())


def test_a_stream_sent_again_while_its_abandoned_attempt_is_still_in_the_engine_completes(service):
    """The stream's connection ends under it while its shard lives: the shard aborts the attempt, but its engine
    thread is away in a step and takes the abort up after the client's resend has arrived. The resend is served
    (its own id), the stream has the tokens of an uninterrupted run, and the abandoned attempt leaves the engine
    (aborted, its KV blocks back)."""
    svc, client = service
    actor = svc.actors[0]
    prompt = _prompt(1)
    (want,) = client.generate([prompt], SP)
    aborted = ray.get(actor.stats.remote())["aborted"]
    ray.get(actor.debug_slow_engine.remote(PAUSE_S))
    try:
        # at its first token the engine thread has just begun its pause: the client walks away from the attempt
        toks, res = _stream(client, prompt, lambda: client._loop.call_soon_threadsafe(
            client.dispatch.channels[0].drop_conn, "test: the client walked away from a live connection"))
    finally:
        ray.get(actor.debug_slow_engine.remote(0))
    assert res.error is None, res
    assert toks == res.output_token_ids == want.output_token_ids and res.finish_reason == "length"
    assert res.timings["attempts"] == 2 and res.timings["resumed"] == 1
    assert "~" not in res.id  # the caller's id, not the attempt's
    _wait(lambda: _idle(actor), what="an attempt is left on the shard")
    assert ray.get(actor.stats.remote())["aborted"] - aborted == 1  # the abandoned attempt, aborted there


async def _hear_restart_late(watch) -> bool:
    """The restart wait's probe, with the shard's incarnation still recorded as the one before its death."""
    watch.incarnation[0] = "the-incarnation-before-the-restart"
    return await asyncio.shield(watch.restart(0))


def test_a_restart_heard_late_keeps_the_connection_made_to_the_new_incarnation(service):
    """The restart wait hears the shard's new incarnation after a stream has connected to it (as in the H200 run):
    the connection to the dead incarnation goes, that one stays, and the stream on it goes on untouched."""
    svc, client = service
    actor = svc.actors[0]
    watch = client.dispatch.shards
    _wait(lambda: 0 in client.dispatch.conns and client.dispatch.conns[0].broken is None, what="not connected")
    conn, seen, heard = client.dispatch.conns[0], client.counters.restarts_seen, []
    ray.get(actor.debug_slow_engine.remote(0.1))  # the stream outlives the probe
    try:
        toks, res = _stream(client, _prompt(2), lambda: heard.append(
            asyncio.run_coroutine_threadsafe(_hear_restart_late(watch), client._loop).result(timeout=30)))
    finally:
        ray.get(actor.debug_slow_engine.remote(0))
    assert heard == [True] and client.counters.restarts_seen == seen + 1  # a new incarnation, as far as it knew
    assert res.error is None and res.timings["attempts"] == 1 and res.timings["resumed"] == 0, res
    assert len(toks) == SP.max_tokens
    assert client.dispatch.conns[0] is conn and conn.broken is None
    _wait(lambda: _idle(actor), what="an attempt is left on the shard")


def test_a_request_while_its_only_shard_restarts_waits_for_it_without_routing_again_and_again(service):
    """One shard, restarting: a request made meanwhile is held at its channel and sent once the shard can take it.
    Before, the channel gave it back to routing at once, and routing (no other shard) sent it straight back: a router
    call per loop turn while the shard restarted (3,560 calls in 9 s on CPU) and as many attempts counted."""
    from helpers import answering

    svc, client = service
    actor = svc.actors[0]
    answering(actor)
    ray.kill(actor, no_restart=False)
    _wait(lambda: 0 in client.dispatch.shards.restarting, what="the client did not see its shard die")
    before = client.counters.route_calls
    (res,) = client.generate([_prompt(9)], SP)
    assert res.error is None and len(res.output_token_ids) == SP.max_tokens, res
    assert client.counters.route_calls - before <= 3 and res.timings["attempts"] <= 3, (
        client.counters.route_calls - before, res.timings["attempts"])
    _wait(lambda: _idle(actor), what="an attempt is left on the shard")
