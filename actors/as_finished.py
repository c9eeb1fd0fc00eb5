"""Results as they finish: the tasks serving a batch's requests, their results handed out in groups as they
finish. A group is what finished by the time the first of it did, plus what finishes within `window_s` after
that while others still run (the engine finishes several requests in one step; they travel together). With
nothing else running a group leaves at once: no timer is waited out before a lone result. One timer per
group (loop.call_at; the project supports Python 3.10, so no asyncio.timeout_at), no task per result."""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator


class _Finished:
    """Finished tasks not yet handed out, and the one future the generator sleeps on: a finishing task or the
    group's timer wakes it."""
    __slots__ = ("tasks", "waiter", "expired")

    def __init__(self) -> None:
        self.tasks: deque[asyncio.Task] = deque()
        self.waiter: asyncio.Future | None = None
        self.expired = False

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def put(self, task: asyncio.Task) -> None:
        self.tasks.append(task)
        self._wake()

    def expire(self) -> None:
        self.expired = True
        self._wake()

    async def wait(self, loop: asyncio.AbstractEventLoop) -> None:
        self.waiter = loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


async def as_finished(tasks: list[asyncio.Task], window_s: float) -> AsyncIterator[list]:
    """The tasks' results in groups, in finishing order; every task's result once. The caller cancels the
    tasks when it stops early."""
    loop = asyncio.get_running_loop()
    done = _Finished()
    for t in tasks:
        t.add_done_callback(done.put)
    left = len(tasks)
    while left:
        while not done.tasks:
            await done.wait(loop)
        finished = [done.tasks.popleft()]
        left -= 1
        deadline = loop.time() + window_s
        done.expired = window_s <= 0.0
        timer = None
        try:
            while left:  # what finished meanwhile, or within the window, joins the group
                if done.tasks:
                    finished.append(done.tasks.popleft())
                    left -= 1
                elif done.expired:
                    break
                else:
                    if timer is None:
                        timer = loop.call_at(deadline, done.expire)
                    await done.wait(loop)
        finally:
            if timer is not None:
                timer.cancel()
        yield [t.result() for t in finished]
