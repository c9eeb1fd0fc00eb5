"""The client's bookkeeping when requests leave it unanswered, on a real local Ray cluster (two CPU shards of the
tiny model, the named router): a shard that dies under a batch, a caller that gives up on requests still queued at
the client (batch window, flow-control credit, overload resend delay). Each request's estimated work leaves the
router's count of its shard exactly once (the router's `routed` and `completed` counts per shard match again), and
a request nobody waits for any more is never sent."""
import asyncio
import concurrent.futures
import time

import numpy as np
import pytest
import ray
from helpers import answering, kill_mid_burst, unbounded_credit

from flame_llm import SamplingParams
from flame_llm.serving.client import Client
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ServiceConfig

ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 1024, "max_num_seqs": 16, "cpu_kvcache_gib": 0.0625}


@pytest.fixture(scope="module")
def service(tiny_llama):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = ServiceConfig.from_kwargs(model=tiny_llama, engine=ENGINE, num_shards=2, cpu_per_shard=0.5,
                                    policy="cumulative", namespace="test-leftovers", max_inflight_requests=8,
                                    max_queued_requests=8)
    svc = start_service(cfg)
    yield svc
    svc.stop(timeout_s=10)
    ray.shutdown()


def _prompts(n, length, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=length).tolist() for _ in range(n)]


def _router_open(svc) -> list[tuple[int, float]]:
    """Per shard: requests charged and not yet completed or forgotten, and their outstanding estimated work."""
    return [(s["routed"] - s["completed"], s["outstanding_work"]) for s in ray.get(svc.router.stats.remote())["shards"]]


def _settled(svc, before, timeout_s: float) -> None:
    """Wait until the router's open counts are `before` again (completions travel without being awaited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = _router_open(svc)
        if [n for n, _ in now] == [n for n, _ in before]:
            break
        assert time.monotonic() < deadline, f"router open (requests, work) per shard {now}; before {before}"
        time.sleep(0.05)
    assert [w for _, w in now] == pytest.approx([w for _, w in before], abs=1e-6)


def _shard_batches(svc) -> int:
    return sum(s["batches"] for s in ray.get([a.stats.remote() for a in svc.actors.values()]))


def _on_loop(client, coro, timeout_s: float = 60):
    return asyncio.run_coroutine_threadsafe(coro, client._loop).result(timeout=timeout_s)


@pytest.mark.parametrize("max_retries", [20, 0])
def test_a_lost_shard_takes_back_its_work_at_the_router(service, max_retries):
    """A shard killed mid-batch: its requests are routed again (max_retries 0: they fail with shard_died). Either
    way the work charged to the dead shard for them leaves the router's count, once: before, it stayed (the
    router's routed - completed for the shard grew by the requests lost there)."""
    svc = service
    client = Client.for_service(svc, max_retries=max_retries)
    try:
        before = _router_open(svc)
        victim = svc.actors[0]
        t, out = kill_mid_burst(client, victim, _prompts(32, 60, seed=1 + max_retries),
                                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        t.join(timeout=180)
        res = out["res"]
        assert len(res) == 32
        errors = [r.error.code for r in res if r.error is not None]
        if max_retries:
            assert errors == []
        else:
            assert errors and set(errors) == {"shard_died"}
        _settled(svc, before, 10.0)
        answering(victim, 120.0)  # the burst may end before the restart (its requests went on elsewhere)
    finally:
        client.close()


async def _cancel_when(client, prompts, sp, ready, what: str):
    """Start an agenerate on the client's loop, cancel it once ready() holds; the requests' state right after."""
    task = asyncio.ensure_future(client.agenerate(prompts, sp))
    deadline = time.monotonic() + 30
    while not ready():
        assert time.monotonic() < deadline and not task.done(), f"never {what}"
        await asyncio.sleep(0.002)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_requests_aborted_in_the_batch_window_are_never_sent(service):
    """A generate() cancelled while its requests wait out the batch window: they leave the batcher at once (before,
    the window's flush sent them anyway, and an abort to each shard to refuse them there), their work leaves the
    router's count, and no payload or abort goes to a shard."""
    svc = service
    client = Client.for_service(svc, batch_window_ms=1500.0)
    d = client.dispatch
    for b in d.channels.values():  # the requests wait out the window, as resent ones do (a call's formed batch
        real = b.flush  # leaves at once)
        b.flush = lambda why, real=real: None if why == "formed" else real(why)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        before, shard_batches = _router_open(svc), _shard_batches(svc)

        async def main():
            await _cancel_when(client, _prompts(6, 12, seed=3), sp,
                               lambda: sum(len(b.items) for b in d.channels.values()) == 6, "queued")
            return [(len(b.items), b.timer) for b in d.channels.values()]

        assert _on_loop(client, main()) == [(0, None), (0, None)]
        time.sleep(2.0)  # past the window
        assert client.counters.batches == 0 and client.counters.aborts_sent == 0
        assert _shard_batches(svc) == shard_batches
        _settled(svc, before, 5.0)
        assert [r.error for r in client.generate(_prompts(2, 12, seed=4), sp)] == [None] * 2
    finally:
        client.close()


def test_requests_aborted_while_held_for_credit_leave_at_once(service):
    """A generate() cancelled while its requests wait for their shards' flow-control credit: they leave the credit
    queue and the router's count at once (before, they stayed until credit came back), nothing is sent, and the
    requests behind them are served."""
    svc = service
    client = Client.for_service(svc)
    d = client.dispatch
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        before, shard_batches = _router_open(svc), _shard_batches(svc)

        async def main():
            full = dict(d.outstanding)
            for c in d.channels.values():
                c.outstanding = c.capacity  # no room anywhere: the requests are held
            await _cancel_when(client, _prompts(6, 12, seed=5), sp,
                               lambda: sum(len(c.held) for c in d.channels.values()) == 6, "held")
            held = [len(c.held) for c in d.channels.values()]
            open_now = await asyncio.to_thread(_router_open, svc)
            for s, c in d.channels.items():
                c.outstanding = full[s]
            return held, open_now

        held, open_now = _on_loop(client, main())
        assert held == [0, 0]
        assert [n for n, _ in open_now] == [n for n, _ in before]  # forgotten at once, not when credit came back
        assert client.counters.batches == 0 and client.counters.aborts_sent == 0
        assert _shard_batches(svc) == shard_batches
        _settled(svc, before, 5.0)
        assert [r.error for r in client.generate(_prompts(2, 12, seed=6), sp)] == [None] * 2
    finally:
        client.close()


def test_requests_aborted_while_waiting_to_resend_leave_at_once(service):
    """With credit past what the shards admit (as when other clients share them) a burst meets full admission
    queues and its overloaded requests wait out their shards' retry hints at the client. Cancelled then, they leave
    at once: their resend timers are cancelled and their work leaves the router's count (before, each stayed
    until its timer fired, and an abort went to its shard)."""
    svc = service
    client = Client.for_service(svc)
    unbounded_credit(client)
    d = client.dispatch
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    try:
        before = _router_open(svc)

        async def main():
            def resending() -> int:
                return sum(len(c.retrying) for c in d.channels.values())

            await _cancel_when(client, _prompts(48, 16, seed=7), long, lambda: resending() >= 4, "resending")
            return resending(), [h for h in client._loop._scheduled if not h.cancelled()
                                      and getattr(h._callback, "__name__", "") == "_retry_now"]

        assert _on_loop(client, main()) == (0, [])
        _settled(svc, before, 10.0)  # the ones in flight were aborted on their shards and answered
        assert [r.error for r in client.generate(_prompts(2, 12, seed=8), SamplingParams(max_tokens=4))] == [None] * 2
    finally:
        client.close()


def test_a_stream_cancelled_while_waiting_for_credit_leaves_the_credit_queue(service):
    """A stream cancelled while it waits for a unit of its shard's credit leaves the shard's credit queue at once
    (before, its cancelled wait stayed queued until credit came back)."""
    svc = service
    client = Client.for_service(svc)
    d = client.dispatch
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def read(prompt):
        return [c async for c in client.stream_chunks(prompt, sp)]

    async def main():
        full = dict(d.outstanding)
        for c in d.channels.values():
            c.outstanding = c.capacity
        task = asyncio.ensure_future(read(_prompts(1, 12, seed=9)[0]))
        deadline = time.monotonic() + 30
        while not any(c.held for c in d.channels.values()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)  # the stream's task runs its cancellation
        held = [len(c.held) for c in d.channels.values()]
        for s, c in d.channels.items():
            c.outstanding = full[s]
        return held

    try:
        before = _router_open(svc)
        assert _on_loop(client, main()) == [0, 0]
        _settled(svc, before, 5.0)
    finally:
        client.close()


@pytest.mark.parametrize("leave", ["cancel", "close"])
def test_requests_left_while_their_dead_shard_restarts_are_forgotten_once(service, leave):
    """The caller cancels its generate(), or closes the client, while the client waits for a killed shard's
    restart to send the lost batch again: the lost requests' work left the router's count when the shard died,
    and neither the abort nor the close takes it back a second time (the router's routed and completed counts
    per shard match again, not one more completed than routed)."""
    svc = service
    client = Client.for_service(svc)
    victim = svc.actors[1]
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    try:
        before = _router_open(svc)

        async def main():
            # prompts of their own per case: the router places prompts the last case saw on the shard that lived
            prompts = _prompts(12, 20, seed=10 if leave == "cancel" else 11)
            task = asyncio.ensure_future(client.agenerate(prompts, long))
            deadline = time.monotonic() + 60
            while (await asyncio.to_thread(lambda: ray.get(victim.stats.remote())["inflight_requests"])) == 0:
                assert time.monotonic() < deadline and not task.done()
            ray.kill(victim, no_restart=False)
            while 1 not in client.dispatch.shards.restarting:  # the client saw it die and waits for it
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.01)
            if leave == "cancel":
                task.cancel()
            return task

        task = _on_loop(client, main())
        if leave == "close":
            client.close()
        with pytest.raises((asyncio.CancelledError, concurrent.futures.CancelledError)):
            _on_loop(client, asyncio.wait_for(task, 10)) if leave == "cancel" else task.result()
        _settled(svc, before, 60.0)  # the restart's drop_shard and the answers of the shard that lived
    finally:
        client.close()
        answering(victim, 120.0)  # for the next test


def test_requests_held_for_a_dead_shards_credit_go_to_the_other_shard(service):
    """A burst held at the client for shard 0's credit when shard 0 dies: those requests are routed to shard 1 at
    once instead of waiting out shard 0's restart (an engine's whole startup on a GPU) and going back to it. Every
    request completes, and the held ones are served by shard 1."""
    svc = service
    client = Client.for_service(svc)
    d = client.dispatch
    victim = svc.actors[0]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    try:
        async def main():
            task = asyncio.ensure_future(client.agenerate(_prompts(64, 20, seed=20), sp))
            deadline = time.monotonic() + 60
            while not any(hasattr(p, "request") for p in d.channels[0].held):  # requests, not stream waiters
                assert time.monotonic() < deadline and not task.done(), "nothing was held for shard 0's credit"
                await asyncio.sleep(0.002)
            held = {p.request.id for p in d.channels[0].held if hasattr(p, "request")}
            ray.kill(victim, no_restart=False)
            return task, held

        task, held = _on_loop(client, main())
        res = _on_loop(client, asyncio.wait_for(task, 180), timeout_s=200)
        assert [r.error for r in res] == [None] * 64
        served = {r.id: r.shard for r in res}
        assert held and {served[i] for i in held} == {1}, {i: served[i] for i in held}
    finally:
        client.close()
        answering(victim, 120.0)  # for the next test
