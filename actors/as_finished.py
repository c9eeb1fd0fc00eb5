"""Results as they finish: the tasks serving a batch's requests, their results handed out in groups as they
finish. A group is what finished by the time the first of it did, plus what finishes within `window_s` after
that while others still run (the engine finishes several requests in one step; they travel together). With
nothing else running a group leaves at once: no timer is waited out before a lone result."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


async def as_finished(tasks: list[asyncio.Task], window_s: float) -> AsyncIterator[list]:
    """The tasks' results in groups, in finishing order; every task's result once. The caller cancels the
    tasks when it stops early."""
    loop = asyncio.get_running_loop()
    done: asyncio.Queue[asyncio.Task] = asyncio.Queue()
    for t in tasks:
        t.add_done_callback(done.put_nowait)
    left = len(tasks)
    while left:
        finished = [await done.get()]
        left -= 1
        deadline = loop.time() + window_s
        while left:  # what finished meanwhile, or within the window, joins the group
            if done.empty():
                try:
                    finished.append(await asyncio.wait_for(done.get(), deadline - loop.time()))
                except TimeoutError:
                    break
            else:
                finished.append(done.get_nowait())
            left -= 1
        yield [t.result() for t in finished]
