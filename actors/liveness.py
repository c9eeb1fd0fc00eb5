"""Whether an engine actor still serves (issue 37): its health method runs on the control loop, which stays up when
the loop that serves requests and the stream port is wedged (blocked, or its process out of file descriptors). The
liveness probe runs a no-op on the serving loop from the control loop and times it; the supervisor
(flame_llm/serving/service.py, replace_unhealthy_shards) restarts a shard that fails it."""
from __future__ import annotations

import asyncio
import os
import resource
import time
from dataclasses import dataclass

LIVE_TIMEOUT_S = 5.0  # the serving loop answers a no-op within this, or the shard is unhealthy
FD_HIGH = 0.9  # a process holding this fraction of its descriptor limit is unhealthy (it cannot accept or call)


@dataclass(slots=True, frozen=True)
class Liveness:
    ok: bool
    loop_lag_s: float | None  # how long the serving loop took to run a no-op; None: not within the timeout
    fds: int  # open file descriptors of the shard's process (-1: unknown on this platform)
    fd_limit: int
    why: str = ""  # what is wrong when not ok


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


async def _now() -> float:
    return time.perf_counter()


async def probe(serve_loop: asyncio.AbstractEventLoop | None, timeout_s: float = LIVE_TIMEOUT_S) -> Liveness:
    """From another loop (the control group's): whether `serve_loop` runs a no-op within timeout_s, and whether
    the process has descriptors left. A loop not yet known (nothing served yet) counts as answering."""
    fds, limit = open_fds(), resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    lag, why = 0.0, ""
    if serve_loop is not None:
        t0 = time.perf_counter()
        fut = asyncio.run_coroutine_threadsafe(_now(), serve_loop)
        try:
            lag = await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s) - t0
        except TimeoutError:
            fut.cancel()
            lag, why = None, f"the serving loop did not run a no-op within {timeout_s:g}s (wedged)"
    if not why and 0 < limit != resource.RLIM_INFINITY and fds >= FD_HIGH * limit:
        why = f"{fds} file descriptors open of a limit of {limit}"
    return Liveness(not why, lag, fds, limit, why)
