"""Admission gate of one engine actor: bounds in-flight tokens and requests, FIFO waiting, rejection
with a retry hint past the queue limit. Lives on one asyncio loop (the actor's submit group)."""
from __future__ import annotations

import asyncio
import time
from collections import deque


class Overloaded(Exception):
    def __init__(self, retry_after_s: float, queued: int, limit: int):
        super().__init__(f"admission queue is full ({queued} waiting, max_queued_requests={limit}); "
                         f"retry after {retry_after_s:.3f}s")
        self.retry_after_s = retry_after_s


class Admission:
    def __init__(self, max_tokens: int, max_requests: int, max_queued: int):
        assert max_tokens >= 1 and max_requests >= 1 and max_queued >= 0
        self.max_tokens, self.max_requests, self.max_queued = max_tokens, max_requests, max_queued
        self.tokens = 0
        self.requests = 0
        self.queued_tokens = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()
        self.admitted = 0
        self.rejected = 0
        self.waited = 0
        # released tokens per second, smoothed: drives the retry hint
        self._rate = 0.0
        self._rate_t = time.perf_counter()
        self._rate_tokens = 0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _fits(self, cost: int) -> bool:
        if self.requests == 0:
            return True  # a request larger than the token bound still runs, alone
        return self.requests < self.max_requests and self.tokens + cost <= self.max_tokens

    def _take(self, cost: int) -> None:
        self.tokens += cost
        self.requests += 1
        self.admitted += 1

    async def acquire(self, cost: int) -> None:
        """Reserve `cost` tokens and one request slot; wait FIFO when over the bounds; raise Overloaded
        when max_queued requests are already waiting."""
        if not self._waiters and self._fits(cost):
            self._take(cost)
            return
        if len(self._waiters) >= self.max_queued:
            self.rejected += 1
            raise Overloaded(self.retry_after_s(cost), len(self._waiters), self.max_queued)
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((cost, fut))
        self.queued_tokens += cost
        self.waited += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(cost)  # granted just as we were cancelled
            else:
                self._waiters.remove((cost, fut))
                self.queued_tokens -= cost
            raise

    def release(self, cost: int) -> None:
        assert self.requests >= 1 and self.tokens >= cost
        self.tokens -= cost
        self.requests -= 1
        self._rate_tokens += cost
        now = time.perf_counter()
        if now - self._rate_t >= 0.5:
            inst = self._rate_tokens / (now - self._rate_t)
            self._rate = inst if self._rate == 0.0 else 0.7 * self._rate + 0.3 * inst
            self._rate_t, self._rate_tokens = now, 0
        while self._waiters and self._fits(self._waiters[0][0]):
            c, fut = self._waiters.popleft()
            self.queued_tokens -= c
            self._take(c)
            fut.set_result(None)

    def retry_after_s(self, cost: int = 0) -> float:
        """Time for the work ahead (in flight and queued) to drain at the recent release rate."""
        if self._rate <= 0.0:
            return 0.5
        return min(max((self.tokens + self.queued_tokens + cost) / self._rate, 0.05), 30.0)

    def stats(self) -> dict:
        return {"inflight_tokens": self.tokens, "inflight_requests": self.requests, "queued": len(self._waiters),
                "queued_tokens": self.queued_tokens, "admitted": self.admitted, "rejected": self.rejected,
                "waited": self.waited}
