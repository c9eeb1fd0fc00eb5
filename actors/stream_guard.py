"""The stream port's bounds (issue 37): what a connection to an engine actor's stream server may hold, and for how
long, so that a flood of connections (idle, slow, or bad) cannot use up the actor's file descriptors or its log.

- A connection presents its hello within `hello_timeout_s` of its accept, or it is closed (by a timer at the
  earliest deadline, actors/stream_accept.py). With `accept_share` under 1 or `defer_accept`, the deadline counts
  from the connection's connect in the kernel (TCP_INFO), not from its accept.
- Under a flood (pending connections past a mark, or the backlog more than a batch), accepting is paced: small
  rounds, and pauses after each, so that accepting and closing take at most `accept_share` of the loop's CPU time.
- With `defer_accept` (Linux), the kernel hands a connection to the loop only once its hello's first bytes arrive
  (or at the end of the longest of its deferral periods within the hello deadline).
- At most `max_pending` connections wait for their hello; one more closes the oldest of them (a valid client sends
  its hello with its connect, so it leaves the pending set within a round trip; a flood only evicts itself).
- At most `max_connections` connections are past their hello; one more is closed at its hello (counted).
- A connection past its hello with no stream open and no frame for `idle_timeout_s` is closed (clients ping).
- A frame whose first byte arrived completes within `frame_timeout_s` plus its length at 1 MiB/s.
- A connection's unsent bytes over `max_unsent_bytes` for `drain_timeout_s` (a peer that does not read) cut it
  off (actors/stream_out.py).
- With `refuse_reset`, a connection refused before its hello (deadline, cap, bad token) is reset (SO_LINGER 0):
  the kernel sends one RST and forgets it, instead of a FIN exchange that leaves the socket in TIME_WAIT here for
  60 s when the peer closes after it (a flood's every connection).
- Accept failing for want of file descriptors (EMFILE, ENFILE) backs off accepting (up to ACCEPT_BACKOFF_MAX_S)
  and closes the older half of the pending connections; connections already served go on.

Refusals are logged as a summary line at most every LOG_EVERY_S (RefusalLog), never one line per event."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

ACCEPT_BACKOFF_MIN_S = 0.02
ACCEPT_BACKOFF_MAX_S = 1.0
LOG_EVERY_S = 10.0


@dataclass(slots=True, frozen=True)
class StreamLimits:
    """The stream server's bounds; the defaults are ShardOptions' (actors/shard_options.py, stream_* fields)."""
    hello_timeout_s: float
    max_pending: int
    max_connections: int
    idle_timeout_s: float
    frame_timeout_s: float
    coalesce: bool  # a connection's frames of one loop turn leave as one write (actors/stream_out.py)
    max_unsent_bytes: int  # a connection's unsent bytes past this make its streams wait for the peer
    drain_timeout_s: float  # a peer that does not read within this (over the bound) is cut off
    accept_share: float  # under a flood, the accept path's share of the loop's CPU time (1.0: unpaced)
    defer_accept: bool  # TCP_DEFER_ACCEPT: silent connections stay in the kernel (actors/stream_kernel.py)
    refuse_reset: bool  # refused before the hello: an RST (no FIN exchange, no TIME_WAIT left here)


class RefusalLog:
    """Counts refusals by reason and logs them as one summary line at most every `every_s` seconds: the first one
    at once, later ones when the interval is over (a timer flushes what is left after a burst)."""

    def __init__(self, log: logging.Logger, name: str, every_s: float = LOG_EVERY_S) -> None:
        self.log, self.name, self.every_s = log, name, every_s
        self.counts: Counter[str] = Counter()
        self.lines = 0  # summary lines written (tests: bounded however many refusals)
        self._next_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def note(self, reason: str) -> None:
        self.counts[reason] += 1
        now = time.monotonic()
        if now >= self._next_at:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_at(
                asyncio.get_running_loop().time() + (self._next_at - now), self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.counts:
            return
        total = sum(self.counts.values())
        parts = ", ".join(f"{r}: {n}" for r, n in self.counts.most_common())
        self.log.warning("shard %s: %d stream connection(s) refused or closed (%s)%s", self.name, total, parts,
                         f"; the next summary in {self.every_s:g}s at the earliest" if total > 1 else "")
        self.lines += 1
        self.counts.clear()
        self._next_at = time.monotonic() + self.every_s

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
