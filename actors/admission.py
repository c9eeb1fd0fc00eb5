"""Admission gate of one engine actor: bounds in-flight tokens and requests, FIFO waiting, rejection
with a retry hint past the queue limit. Lives on one asyncio loop (the actor's serving loop).

Retry hints track when capacity frees, not when everything drains: a queue slot frees each time the
queue's head is admitted, which takes a release (or, for a head too big for the free tokens, enough
released tokens). Recent releases measure how long a request holds its slot; the requests in flight now
free slots at that pace. The first rejection gets the time until the head gets in; each further one is
promised the next slot after that, one slot interval later (a slot clock), so a batch's rejected
requests come back spread at the rate slots free, each jittered within its interval. Hints are bounded
to [HINT_MIN_S, HINT_MAX_S] (those cut to the maximum spread over its last JITTER fraction).

Fair: callers (a client: its Ray job and client id) wait in their own FIFO queues, and each
free slot goes to the next caller in turn (round robin), so one client's burst cannot keep another's request
out. The queue is shared and bounded by max_queued as before; once it holds max_queued requests, a caller at
or above its fair share of it (max(1, max_queued // callers waiting)) is rejected, and a caller below its share
may still wait, but only while the queue is past max_queued by fewer requests than there are callers waiting:
each waiting caller may push it past by one. At most max_queued callers wait at once (each could have had one
place in a queue of max_queued), so at most 2 x max_queued requests wait (the one FIFO queue of before, held
max_queued; retired with the shard field fair_admission, issue 38). A cancelled wait lets the next request in
when it fits (before, in one FIFO, a cancelled head too big for the free tokens left the smaller requests
behind it waiting for the next release).
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable, Hashable

from flame_llm.fair_queue import FairQueue
from flame_llm.limits import max_output_tokens

HINT_MIN_S = 0.01
HINT_MAX_S = 30.0
HINT_COLD_S = 0.5  # first hint before any release was measured
COLD_INTERVAL_S = 0.05  # slot interval before any release was measured
JITTER = 0.1  # hints cut to HINT_MAX_S are spread over its last 10%
RATE_WINDOW = 256  # releases the drain rate is measured over
RATE_HORIZON_S = 30.0  # ... no older than this (but the last two)
MIN_AREA_S = 1e-3  # request-seconds: a hold time over less is measured as over this


def request_cost(prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """The tokens a request is charged: its prompt plus the output the engine can produce, which stops at
    max_model_len (a max_tokens of 10**9 is charged as what fits, not as 10**9)."""
    assert prompt_tokens >= 0 and max_tokens >= 1 and max_model_len >= 1
    return prompt_tokens + max_output_tokens(prompt_tokens, max_tokens, max_model_len)


class Overloaded(Exception):
    def __init__(self, retry_after_s: float, queued: int, limit: int, position: int = 0, why: str = ""):
        why = why or f"admission queue is full ({queued} waiting, max_queued_requests={limit})"
        super().__init__(f"{why}; retry after {retry_after_s:.3f}s")
        self.retry_after_s = retry_after_s
        self.position = position  # queue slots promised to rejected requests before this one's


class Admission:
    def __init__(self, max_tokens: int, max_requests: int, max_queued: int, *,
                 clock: Callable[[], float] = time.perf_counter, rng: random.Random | None = None):
        assert max_tokens >= 1 and max_requests >= 1 and max_queued >= 0
        self.max_tokens, self.max_requests, self.max_queued = max_tokens, max_requests, max_queued
        self.tokens = 0
        self.requests = 0
        self.queued_tokens = 0
        # per caller its waiting (cost, future), FIFO; callers take turns (round robin)
        self._queues = FairQueue()
        self._queued = 0
        self._held: dict[Hashable, int] = {}  # caller -> its requests in flight
        self.admitted = 0
        self.rejected = 0
        self.waited = 0
        self._clock, self._rng = clock, rng or random.Random()
        # recent releases (time, cost, in-flight area at that time); area: the integral of requests in flight
        # over time, so that area / releases is the mean time a request holds its slot (Little's law)
        self._releases: deque[tuple[float, int, float]] = deque()
        self._released_tokens = 0  # over _releases
        self._area, self._area_t = 0.0, clock()
        self._slot_clock = 0.0  # when the next queue slot not yet promised to a rejected request frees

    @property
    def queued(self) -> int:
        return self._queued

    def _head(self) -> tuple[Hashable, int] | None:
        """(caller, cost) of the request whose turn is next, or None with nobody waiting."""
        return (self._queues.head_user(), self._queues.head()[0]) if self._queues else None

    def _full_for(self, key: Hashable) -> str:
        """Why a request of `key` arriving now is rejected, or "" when it may wait."""
        waiting = self._queues.waiting(key)
        callers = self._queues.users + (waiting == 0)  # waiting callers, this one counted
        if waiting == 0 and callers > self.max_queued:
            return (f"admission queue is full ({self._queues.users} callers waiting, the most at once: "
                    f"max_queued_requests={self.max_queued})")
        if self._queued < self.max_queued:
            return ""
        share = max(1, self.max_queued // callers)
        if waiting >= share:
            return (f"admission queue is full for this caller ({waiting} waiting, its share of "
                    f"max_queued_requests={self.max_queued} with {callers} callers waiting: {share})")
        if self._queued - self.max_queued >= callers:  # each waiting caller may pass the bound by one
            return (f"admission queue is full ({self._queued} waiting, max_queued_requests={self.max_queued} "
                    f"+ one per caller waiting: {callers})")
        return ""

    def _fits(self, cost: int) -> bool:
        if self.requests == 0:
            return True  # a request larger than the token bound still runs, alone
        return self.requests < self.max_requests and self.tokens + cost <= self.max_tokens

    def _advance(self) -> float:
        now = self._clock()
        self._area += self.requests * (now - self._area_t)
        self._area_t = now
        return now

    def _take(self, cost: int, key: Hashable) -> None:
        self._advance()
        self.tokens += cost
        self.requests += 1
        self.admitted += 1
        self._held[key] = self._held.get(key, 0) + 1

    async def acquire(self, cost: int, caller: Hashable = None) -> None:
        """Reserve `cost` tokens and one request slot for `caller`; wait in the caller's FIFO queue (served
        in turn with the other callers') when over the bounds; raise Overloaded when the queue is full for
        this caller (see the module docstring)."""
        if not self._queued and self._fits(cost):
            self._take(cost, caller)
            return
        why = self._full_for(caller)
        if why:
            self.rejected += 1
            hint, position = self._reject_hint(cost)
            raise Overloaded(hint, self._queued, self.max_queued, position, why)
        fut = asyncio.get_running_loop().create_future()
        entry = (cost, fut)
        self._queues.append(entry, caller)
        self._queued += 1
        self.queued_tokens += cost
        self.waited += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(cost, caller)  # granted just as we were cancelled
            else:
                if entry in self._queues:  # else a _grant that ran first dropped it
                    self._queues.remove(entry)
                    self._queued -= 1
                    self.queued_tokens -= cost
                self._grant()  # a head too big for the free tokens may have gone: the next may fit
            raise

    def release(self, cost: int, caller: Hashable = None) -> None:
        assert self.requests >= 1 and self.tokens >= cost and self._held.get(caller, 0) >= 1
        now = self._advance()
        self.tokens -= cost
        self.requests -= 1
        self._held[caller] -= 1
        if not self._held[caller]:
            del self._held[caller]
        self._releases.append((now, cost, self._area))
        self._released_tokens += cost
        if len(self._releases) > RATE_WINDOW:
            self._released_tokens -= self._releases.popleft()[1]
        self._grant()

    def _grant(self) -> None:
        """Admit waiting requests while the one whose turn it is fits; its caller's turn then passes."""
        while (head := self._head()) is not None and self._fits(head[1]):
            c, fut = self._queues.popleft()  # its caller goes to the back of the turn
            self._queued -= 1
            self.queued_tokens -= c
            if fut.cancelled():  # its waiter was cancelled and has not run its cleanup yet: nobody to admit
                continue
            self._take(c, head[0])
            fut.set_result(None)

    # ---- retry hints ------------------------------------------------------------------------------
    def drain_rate(self) -> tuple[float, float]:
        """(requests, tokens) per second the requests in flight now release at: the recent releases measure
        how long a request holds its slot (area / releases), and the requests in flight now each free one
        in that time, so a load that rose since (a burst) is counted at its height. (0, 0) before two
        releases."""
        now = self._advance()
        while len(self._releases) > 2 and now - self._releases[0][0] > RATE_HORIZON_S:  # two stay: a stall
            self._released_tokens -= self._releases.popleft()[1]
        if len(self._releases) < 2:
            return 0.0, 0.0
        n = len(self._releases) - 1  # releases after the first, over the area since it
        # area up to now, not to the newest release: a stalled engine's hold time grows and its rate decays
        hold_s = max(self._area - self._releases[0][2], MIN_AREA_S) / n
        rate = max(self.requests, 1) / hold_s
        return rate, rate * (self._released_tokens - self._releases[0][1]) / n

    def _first_slot_s(self, cost: int) -> tuple[float, float]:
        """(seconds until the first queue slot frees, seconds between freed slots) at the measured rate."""
        rate, token_rate = self.drain_rate()
        if rate <= 0.0:
            return HINT_COLD_S, COLD_INTERVAL_S
        interval = 1.0 / rate
        # the head of the queue (or, with no queue, this request) needs a release, and enough free tokens
        head = self._head()
        head = cost if head is None else head[1]
        deficit = self.tokens + head - self.max_tokens
        token_wait = deficit / token_rate if deficit > 0 and token_rate > 0 else 0.0
        return max(interval, token_wait), interval

    def retry_after_s(self, cost: int = 0) -> float:
        """When a request rejected now could get a queue slot: after the slots already promised to requests
        rejected before it (no jitter; the clock is not advanced)."""
        now = self._clock()
        first, _ = self._first_slot_s(cost)
        return min(max(max(self._slot_clock, now + first) - now, HINT_MIN_S), HINT_MAX_S)

    def _reject_hint(self, cost: int) -> tuple[float, int]:
        """A rejected request's hint: the next unpromised slot, plus jitter; advances the slot clock."""
        now = self._clock()
        first, interval = self._first_slot_s(cost)
        start = max(self._slot_clock, now + first)
        position = round((start - now - first) / interval)
        self._slot_clock = min(start + interval, now + HINT_MAX_S)
        hint = start - now + self._rng.uniform(0.0, interval)  # jitter within this slot's interval
        if hint > HINT_MAX_S:  # cut hints must not all come back at one instant either
            hint = HINT_MAX_S * (1.0 - self._rng.uniform(0.0, JITTER))
        return max(hint, HINT_MIN_S), position

    def stats(self) -> dict:
        return {"inflight_tokens": self.tokens, "inflight_requests": self.requests, "queued": self._queued,
                "queued_tokens": self.queued_tokens, "queued_callers": self._queues.users, "admitted": self.admitted,
                "rejected": self.rejected, "waited": self.waited}
