"""The admission gate's retry hints and costs (issue 14): hints track when a queue slot frees, spread a
batch's rejected requests at the rate slots free, with jitter, within bounds; a 10x burst on a simulated
clock keeps the shard busy where the old drain-everything hint left it idle; request_cost charges what the
engine can produce. No Ray: the gate on a virtual-time event loop."""
import asyncio
import math
import random
import selectors

import pytest

from actors.admission import HINT_COLD_S, HINT_MAX_S, HINT_MIN_S, JITTER, Admission, Overloaded, request_cost


class _VirtualSelector(selectors.BaseSelector):
    """A selector that never has I/O: waiting for the next timer moves the virtual clock there instead."""

    def __init__(self) -> None:
        self.now, self._keys = 0.0, {}

    def register(self, fileobj, events, data=None):
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj):
        return self._keys.pop(fileobj)

    def select(self, timeout=None):
        assert timeout is not None, "nothing is scheduled: the simulation would wait forever"
        self.now += max(timeout, 0.0)
        return []

    def get_map(self):
        return self._keys


class _VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.clock = _VirtualSelector()
        super().__init__(self.clock)

    def time(self) -> float:
        return self.clock.now


def _run(main):
    loop = _VirtualLoop()
    try:
        return loop.run_until_complete(main(loop))
    finally:
        loop.close()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _rejections(gate: Admission, n: int, cost: int = 1) -> list[Overloaded]:
    async def main():
        out = []
        for _ in range(n):
            with pytest.raises(Overloaded) as e:
                await gate.acquire(cost)
            out.append(e.value)
        return out
    return asyncio.run(main())


def _steady_gate(hold_s: float = 0.4, slots: int = 4, max_queued: int = 0, max_tokens: int = 10**6):
    """A gate with `slots` requests always in flight, each held hold_s: it frees a slot every hold_s / slots."""
    clock = Clock()
    gate = Admission(max_tokens, slots, max_queued, clock=clock, rng=random.Random(0))

    async def fill():
        for _ in range(slots):
            await gate.acquire(10)
    asyncio.run(fill())
    for _ in range(40):  # staggered releases, each replaced at once
        clock.t += hold_s / slots
        gate.release(10)
        asyncio.run(fill_one(gate))
    return gate, clock


async def fill_one(gate):
    await gate.acquire(10)


# ---- request_cost ----

@pytest.mark.parametrize("prompt, max_tokens, max_model_len, cost", [
    (100, 16, 1024, 116),  # the output fits: prompt + max_tokens
    (100, 10**9, 1024, 1024),  # a huge max_tokens is charged as what the engine can produce
    (1000, 2**31 - 1, 1024, 1024),
    (1023, 5, 1024, 1024),  # the longest prompt leaves room for one token
    (1, 1, 2, 2),
])
def test_request_cost_charges_what_the_engine_can_produce(prompt, max_tokens, max_model_len, cost):
    assert request_cost(prompt, max_tokens, max_model_len) == cost


def test_request_cost_matches_the_engines_cap(tiny_llama):
    from flame_llm import LLM, SamplingParams

    llm = LLM(tiny_llama, block_size=16, max_model_len=40)
    prompt = list(range(3, 33))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True), use_tqdm=False)[0]
    assert request_cost(len(prompt), 10**6, 40) == len(prompt) + len(out.output_token_ids) == 40


# ---- hints ----

def test_cold_gate_hints_are_spread_and_bounded():
    gate = Admission(10, 1, 0, clock=Clock(), rng=random.Random(1))
    asyncio.run(fill_one(gate))  # one in flight, no release measured yet
    hints = [e.retry_after_s for e in _rejections(gate, 5)]
    assert hints[0] >= HINT_COLD_S and all(b > a for a, b in zip(hints, hints[1:]))
    assert max(hints) < HINT_COLD_S + 5 * 0.05  # one 0.05 s slot interval each


def test_hints_follow_the_slot_rate_per_position():
    """Four in flight, each held 0.4 s: a slot frees every 0.1 s. The k-th request rejected in a batch is
    promised the k-th slot: ~0.1 * (k + 1) s, jittered within its 0.1 s, never together with another."""
    gate, _ = _steady_gate()
    rate, token_rate = gate.drain_rate()
    assert rate == pytest.approx(10.0, rel=0.05) and token_rate == pytest.approx(100.0, rel=0.05)
    errs = _rejections(gate, 8)
    hints = [e.retry_after_s for e in errs]
    assert [e.position for e in errs] == list(range(8))
    for k, h in enumerate(hints):
        assert 0.1 * (k + 1) * 0.95 <= h <= 0.1 * (k + 2) * 1.05, (k, hints)
    assert all(b > a for a, b in zip(hints, hints[1:]))
    # the old hint: the time for everything in flight (40 tokens at 100 tokens/s) to drain, for every one
    assert hints[0] < 0.4 / 2


def test_promised_slots_are_released_with_time():
    gate, clock = _steady_gate()
    _rejections(gate, 8)
    assert gate.retry_after_s() == pytest.approx(0.9, rel=0.05)  # eight slots promised ahead
    clock.t += 0.5  # five of them have come and gone
    assert gate.retry_after_s() == pytest.approx(0.4, rel=0.05)


def test_token_bound_head_waits_for_released_tokens():
    """The head of the queue needs 300 more tokens than are free; at 100 released tokens/s it gets in (and a
    queue slot frees) in ~3 s, not one release interval."""
    gate, _ = _steady_gate(max_queued=1, max_tokens=40)

    async def main():
        head = asyncio.ensure_future(gate.acquire(300))  # waits: 40 in flight + 300 > 40
        await asyncio.sleep(0)
        assert gate.queued == 1
        with pytest.raises(Overloaded) as e:
            await gate.acquire(1)
        head.cancel()
        return e.value.retry_after_s
    hint = asyncio.run(main())
    assert 3.0 <= hint <= (3.0 + 0.1) * 1.05


def test_a_stalled_engine_gets_longer_hints_capped():
    gate, clock = _steady_gate()
    fresh = gate.retry_after_s()
    clock.t += 5.0  # nothing released for 5 s: the measured hold time grows
    stalled = gate.retry_after_s()
    # 39 releases after the first over 4 x 3.9 request-seconds, plus 4 x 5 stalled: a slot every 35.6 / 39 / 4 s
    assert fresh == pytest.approx(0.1, rel=0.01) and stalled == pytest.approx(35.6 / 39 / 4, rel=0.01)
    clock.t += 10_000.0
    hints = [e.retry_after_s for e in _rejections(gate, 20)]
    assert all(HINT_MAX_S * (1 - JITTER) <= h <= HINT_MAX_S for h in hints) and all(map(math.isfinite, hints))
    assert len(set(hints)) == 20  # jittered even at the cap


def test_overloaded_message_and_fields():
    gate, _ = _steady_gate()
    e = _rejections(gate, 1)[0]
    assert ("admission queue is full (0 callers waiting, the most at once: max_queued_requests=0); retry after"
            in str(e))
    assert e.position == 0 and HINT_MIN_S <= e.retry_after_s <= HINT_MAX_S


# ---- a 10x burst on a simulated clock ----

class DrainAllHints(Admission):
    """The hint before issue 14, for comparison: the time for everything in flight and queued to drain at
    the smoothed release rate (0.5 s windows), the same for every request rejected at once, no jitter."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ewma, self._win_t, self._win_tokens = 0.0, self._clock(), 0

    def release(self, cost):
        super().release(cost)
        self._win_tokens += cost
        now = self._clock()
        if now - self._win_t >= 0.5:
            inst = self._win_tokens / (now - self._win_t)
            self._ewma = inst if self._ewma == 0.0 else 0.7 * self._ewma + 0.3 * inst
            self._win_t, self._win_tokens = now, 0

    def _reject_hint(self, cost):
        if self._ewma <= 0.0:
            return 0.5, 0
        return min(max((self.tokens + self.queued_tokens + cost) / self._ewma, 0.05), 30.0), 0


def _burst(gate_cls, slots: int, max_queued: int, n: int, hold_s: float = 0.05):
    """n requests at once (10x what the gate holds), each retried after its hint until admitted, held
    hold_s * U(0.5, 1.5). Returns (makespan / ideal, the most attempts one request needed)."""
    async def main(loop):
        gate = gate_cls(10**9, slots, max_queued, clock=loop.time, rng=random.Random(0))
        rng = random.Random(1)
        attempts = []

        async def request():
            tries = 1
            while True:
                try:
                    await gate.acquire(100)
                    break
                except Overloaded as e:
                    tries += 1
                    await asyncio.sleep(e.retry_after_s)
            await asyncio.sleep(hold_s * rng.uniform(0.5, 1.5))
            gate.release(100)
            attempts.append(tries)
        await asyncio.gather(*(request() for _ in range(slots // 2)))  # a light load measures the rate first
        t0 = loop.time()
        await asyncio.gather(*(request() for _ in range(n)))
        return (loop.time() - t0) / (n * hold_s / slots), max(attempts[slots // 2:])
    return _run(main)


@pytest.mark.parametrize("slots, max_queued", [(4, 12), (16, 64), (16, 4)])
def test_ten_x_burst_keeps_the_shard_busy(slots, max_queued):
    n = 10 * (slots + max_queued)
    old_ratio, old_attempts = _burst(DrainAllHints, slots, max_queued, n)
    ratio, attempts = _burst(Admission, slots, max_queued, n)
    assert old_ratio > 1.6 and old_attempts >= 9  # the defect: the shard idles while everyone waits
    assert ratio < 1.3 and attempts <= 4


# ---- fair admission: per-caller queues served in turn (issue 18 item 4) ----

async def _settle():
    for _ in range(4):  # a granted wait resumes, ends, and runs its done callbacks
        await asyncio.sleep(0)


def _fill_caller(gate, caller, n):
    """n requests of `caller`: the admitted ones return at once, the others wait; their tasks."""
    return [asyncio.ensure_future(gate.acquire(10, caller)) for _ in range(n)]


def test_a_second_callers_request_waits_its_turn_instead_of_failing():
    async def main():
        gate = Admission(10**6, 2, 2)  # bounds 2 + 2
        order = []
        a = _fill_caller(gate, "A", 4)  # A holds both slots and both of its queue places
        await _settle()
        assert gate.requests == 2 and gate.queued == 2
        with pytest.raises(Overloaded, match="full for this caller"):  # the queue is full and A holds all of it
            await gate.acquire(10, "A")
        b = asyncio.ensure_future(gate.acquire(10, "B"))  # not rejected: B has a capacity of its own
        b.add_done_callback(lambda _: order.append("B"))
        for t in a[2:]:
            t.add_done_callback(lambda _: order.append("A"))
        await _settle()
        assert gate.queued == 3 and gate.stats()["queued_callers"] == 2
        gate.release(10, "A")  # A's turn came first (it queued first), then B's: round robin
        gate.release(10, "A")
        await _settle()
        assert order == ["A", "B"] and gate.queued == 1
        gate.release(10, "A")
        await asyncio.gather(*a, b)
        assert gate.queued == 0 and gate.stats()["queued_callers"] == 0 and gate._held == {"A": 1, "B": 1}
        assert gate.rejected == 1

    asyncio.run(main())


def test_round_robin_interleaves_callers_whatever_their_backlog():
    async def main():
        gate = Admission(10**6, 1, 100)
        await gate.acquire(10, "A")
        granted = []
        for caller, n in (("A", 6), ("B", 2), ("C", 2)):
            for _ in range(n):
                t = asyncio.ensure_future(gate.acquire(10, caller))
                t.add_done_callback(lambda _, c=caller: granted.append(c))
        await _settle()
        for _ in range(10):
            gate.release(10, granted[-1] if granted else "A")
            await _settle()
        return granted
    assert asyncio.run(main()) == ["A", "B", "C", "A", "B", "C", "A", "A", "A", "A"]
