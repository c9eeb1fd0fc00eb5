"""Fair admission keeps the shared queue bound (review of issue 18 item 4): once max_queued requests wait,
only a caller below its fair share of the queue gets in, each waiting caller passing the bound by one at
most, and at most max_queued callers wait; so at most 2 x max_queued requests wait, where per-caller
capacities let 256 callers queue 256 x (max_requests + max_queued). A cancelled wait lets the next request in
when it fits. (The one-FIFO gate, fair=False, was retired with the shard field fair_admission: issue 38.) No Ray."""
import asyncio
import random

import pytest

from actors.admission import Admission, Overloaded


async def _settle():
    for _ in range(4):
        await asyncio.sleep(0)


def _try(gate, caller, cost=10):
    """One acquire of `caller`, as a task (done at once when admitted or rejected)."""
    t = asyncio.ensure_future(gate.acquire(cost, caller))
    return t


def test_many_flooding_callers_stay_within_twice_max_queued():
    async def main():
        gate = Admission(10**6, 1, 8)
        tasks = []
        for caller in range(50):
            for _ in range(20):
                tasks.append(_try(gate, caller))
                await _settle()
        assert gate.queued <= 2 * 8 and gate.stats()["queued_callers"] <= 8
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert gate.queued == 0 and not gate._queues
        return gate.rejected

    assert asyncio.run(main()) >= 50 * 20 - 1 - 16


def test_a_caller_below_its_share_gets_in_when_the_queue_is_full():
    async def main():
        gate = Admission(10**6, 1, 8)
        a = [_try(gate, "A") for _ in range(9)]  # one in flight, eight waiting: the queue is full
        await _settle()
        assert gate.requests == 1 and gate.queued == 8
        with pytest.raises(Overloaded, match=r"full for this caller \(8 waiting, its share .* 1 callers waiting: 8\)"):
            await gate.acquire(10, "A")
        b = [_try(gate, "B"), _try(gate, "B")]  # below its share (4): each may pass the bound by one
        await _settle()
        assert gate.queued == 10 and all(not t.done() for t in b)
        with pytest.raises(Overloaded, match=r"\(10 waiting, max_queued_requests=8 \+ one per caller waiting: 2\)"):
            await gate.acquire(10, "B")
        c = _try(gate, "C")  # a new caller still gets a place
        await _settle()
        assert gate.queued == 11 and not c.done()
        order = []
        for t, who in [*((t, "A") for t in a[1:]), *((t, "B") for t in b), (c, "C")]:
            t.add_done_callback(lambda _, w=who: order.append(w))
        for _ in range(4):
            gate.release(10, order[-1] if order else "A")
            await _settle()
        assert order == ["A", "B", "C", "A"]  # round robin
        for t in [*a, *b, c]:
            t.cancel()
        await asyncio.gather(*a, *b, c, return_exceptions=True)

    asyncio.run(main())


def test_random_traffic_keeps_the_bounds_and_never_rejects_a_caller_below_its_share_under_the_bound():
    async def main():
        rng = random.Random(7)
        gate = Admission(10**6, 3, 6)
        held, waiting = [], []
        for _ in range(3000):
            op = rng.random()
            if op < 0.6:
                caller = rng.randrange(12)
                w = gate._queues.waiting(caller)
                callers = gate._queues.users + (w == 0)
                may = (not gate.queued and gate._fits(10)) or gate.queued < gate.max_queued or (
                    callers <= gate.max_queued and w < max(1, gate.max_queued // callers)
                    and gate.queued - gate.max_queued < callers)
                t = _try(gate, caller)
                await _settle()
                if t.done() and t.exception() is not None:
                    assert isinstance(t.exception(), Overloaded) and not may
                else:
                    assert may
                    (held if t.done() else waiting).append((t, caller))
            elif op < 0.85 and held:
                _, caller = held.pop(rng.randrange(len(held)))
                gate.release(10, caller)
                await _settle()
            elif waiting:
                t, _ = waiting.pop(rng.randrange(len(waiting)))
                t.cancel()
                await _settle()
            moved = [(t, c) for t, c in waiting if t.done()]
            waiting = [(t, c) for t, c in waiting if not t.done()]
            held += [(t, c) for t, c in moved if not t.cancelled()]
            assert gate.queued == len(waiting) <= gate.max_queued + gate._queues.users
            assert gate._queues.users <= gate.max_queued and gate.queued <= 2 * gate.max_queued
        return gate.rejected

    assert asyncio.run(main()) > 100  # the bounds were reached often


def test_a_cancelled_head_lets_the_next_in():
    """A cancelled head too big for the free tokens lets a smaller request behind it in at once (before, it waited
    for the next release)."""
    async def main():
        gate = Admission(100, 4, 4)
        await gate.acquire(60, "A")
        big = _try(gate, "A", 50)
        small = _try(gate, "B", 10)
        await _settle()
        assert gate.queued == 2 and not small.done()
        big.cancel()
        await _settle()
        assert small.done() and small.exception() is None and gate.queued == 0 and gate.tokens == 70

    asyncio.run(main())


# ---- as_finished: one timer per group, no task per result ----

def test_as_finished_creates_no_task_per_result():
    from actors.as_finished import as_finished

    async def main():
        loop = asyncio.get_running_loop()

        async def after(i):
            await asyncio.sleep(0.002 * i)
            return i
        tasks = [asyncio.ensure_future(after(i)) for i in range(20)]
        created = []
        loop.set_task_factory(lambda lp, coro, **kw: created.append(coro) or asyncio.Task(coro, loop=lp, **kw))
        groups = [g async for g in as_finished(tasks, 5.0)]
        loop.set_task_factory(None)
        return groups, len(created)

    groups, created = asyncio.run(main())
    assert groups == [list(range(20))] and created == 0


def test_a_waiter_cancelled_before_its_cleanup_runs_is_skipped_by_a_release():
    """Cancelling a waiting request cancels its future at once, but its cleanup runs a loop turn later: a release
    in between found the cancelled future at the head and set its result (InvalidStateError in the shard)."""
    async def main():
        adm = Admission(1000, 1, 8)
        await adm.acquire(10, "a")
        waiter = asyncio.ensure_future(adm.acquire(10, "b"))
        await asyncio.sleep(0)
        assert adm.queued == 1
        waiter.cancel()
        adm.release(10, "a")  # before the waiter's cleanup ran
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (adm.queued, adm.requests, adm.tokens, adm.queued_tokens) == (0, 0, 0, 0)
        await adm.acquire(10, "c")  # the gate still works
        assert adm.requests == 1

    asyncio.run(main())
