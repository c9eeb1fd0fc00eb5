"""The stream server's accepting and its connections before their hello (issue 37), as bare sockets: no asyncio
StreamReader, StreamWriter or task per pending connection, so that a flood of silent connections costs the actor a
descriptor and a few bytes each, and little CPU.

- Each listening socket is a reader callback of the loop that accepts up to ACCEPT_BATCH connections a turn.
- Under a flood (at least a quarter of max_pending connections pending, or the last round a full batch) and with
  accept_share under 1: rounds of FLOOD_BATCH, each followed by a pause of the listening socket (its reader removed)
  long enough that the CPU time of accepting, sweeping and refusing stays within accept_share of the loop's time
  (a round of w seconds: a pause of w (1 - share) / share). The connections then wait in the kernel's backlog (new
  valid ones with them: they get in more slowly during a flood, the requests of those in go on).
- A pending connection's socket is a reader callback that reads exactly its hello frame (never a byte past it: the
  connection's next frames stay in the kernel for the asyncio stream that serves it after), then hands the socket
  to `on_hello` (the server's) with the token checked.
- One timer, at the earliest hello deadline (a heap of deadlines), closes the pending connections past theirs. With
  accept_share under 1 or defer_accept, a deadline counts from the connection's connect in the kernel (TCP_INFO,
  actors/stream_kernel.py): one that waited out its deadline in the backlog is closed at its accept.

The bounds and their refusal log are actors/stream_guard.py's, as before: the hello deadline, at most max_pending
connections pending (one more closes the one nearest its deadline), accept backing off when the process is out of
descriptors (and the older half of the pending connections closed)."""
from __future__ import annotations

import asyncio
import errno
import heapq
import socket
import struct
import time
from collections.abc import Callable

from actors.stream_guard import ACCEPT_BACKOFF_MAX_S, ACCEPT_BACKOFF_MIN_S, RefusalLog, StreamLimits
from actors.stream_kernel import AGE_GRAIN_S, connection_age_s, defer_accept
from flame_llm.protocol.stream_frames import (
    HELLO_MAX_BYTES,
    LEN_BYTES,
    Frame,
    FrameError,
    StreamEndpoint,
    frame_length,
    parse_frame,
)

ACCEPT_BATCH = 64  # connections accepted in one turn of the loop, at most
FLOOD_BATCH = 16  # the same under a flood with accept_share under 1
FLOOD_MARK = 0.25  # pending connections at this fraction of max_pending (or more): a flood
SWEEP_GAP_S = 0.005  # the hello deadline timer fires at most this often (those due together close together)
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends an RST and frees the socket at once


class Pending:
    """A connection before its hello: its socket, its deadline (loop time), the hello's bytes read so far."""

    __slots__ = ("sock", "deadline", "buf")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.buf = sock, deadline, b""


class Acceptor:
    """Accepts on the server's listening sockets and holds the connections before their hello (by id, in accept
    order; their deadlines in a heap). on_hello(cid, sock): a connection presented the token (its socket is the
    caller's from then)."""

    def __init__(self, limits: StreamLimits, counters: dict[str, int], refusals: RefusalLog,
                 endpoint: Callable[[], StreamEndpoint | None], on_hello: Callable[[int, socket.socket], None],
                 next_id: Callable[[], int]) -> None:
        self.limits, self.counters, self.refusals = limits, counters, refusals
        self.endpoint, self.on_hello, self.next_id = endpoint, on_hello, next_id
        self.pending: dict[int, Pending] = {}
        self.listeners: list[socket.socket] = []
        self.paced = limits.accept_share < 1
        self.flood_mark = max(1, int(FLOOD_MARK * limits.max_pending))
        self.deferred_s = 0  # the kernel's TCP_DEFER_ACCEPT period (0: off)
        self._aged = self.paced or limits.defer_accept  # deadlines from the kernel's connect time
        self._loop = asyncio.get_running_loop()
        self._backoff = 0.0
        self._full: set[int] = set()  # listening sockets whose last round was a full batch
        self._owed = 0.0  # CPU seconds of sweeping and refusing under a flood, not yet paid for by a pause
        self._timers: set[asyncio.TimerHandle] = set()
        self._deadlines: list[tuple[float, int]] = []  # (deadline, cid); entries of connections gone are skipped
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep_at = float("inf")
        self._last_deadline = float("-inf")  # the deadline of the connection accepted last

    def listen(self, lsock: socket.socket) -> None:
        lsock.setblocking(False)
        if self.limits.defer_accept:
            self.deferred_s = defer_accept(lsock, self.limits.hello_timeout_s)
        self.listeners.append(lsock)
        self._loop.add_reader(lsock.fileno(), self._accept, lsock)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for t in self._timers:
            t.cancel()
        for lsock in self.listeners:
            if lsock.fileno() >= 0:
                self._loop.remove_reader(lsock.fileno())
                lsock.close()
        for cid in list(self.pending):
            self._drop(cid)

    def flooded(self, lsock: socket.socket | None = None) -> bool:
        return self.paced and (len(self.pending) >= self.flood_mark or
                               (lsock is not None and lsock.fileno() in self._full))

    def _accept(self, lsock: socket.socket) -> None:
        flood = self.flooded(lsock)
        t0 = time.thread_time() if flood else 0.0
        batch = FLOOD_BATCH if flood else ACCEPT_BATCH
        for _ in range(batch):
            try:
                sock, _ = lsock.accept()
            except (BlockingIOError, InterruptedError):
                self._full.discard(lsock.fileno())
                break
            except OSError as e:
                self._accept_failed(lsock, e)
                return
            self._backoff = 0.0
            self._pend(sock)
        else:
            self._full.add(lsock.fileno())
        if flood:
            self._pace(lsock, time.thread_time() - t0)

    def _pend(self, sock: socket.socket) -> None:
        """A connection accepted: pending until its hello or its deadline (one past it already is closed)."""
        sock.setblocking(False)
        now = self._loop.time()
        deadline = now + self.limits.hello_timeout_s
        if self._aged:
            deadline -= connection_age_s(sock, self.deferred_s)
            if deadline <= now:  # its deadline went by in the kernel's queue
                self.counters["socket_refused"] += 1
                self.counters["socket_hello_timeouts"] += 1
                self.refusals.note(f"no hello within {self.limits.hello_timeout_s:g}s (in the kernel's queue)")
                self._close_refused(sock)
                return
            # ages come in jiffies: within that grain the kernel queue's order (the accept order) decides, so
            # that the pending cap closes the connections that came first, not one a rounding made look older
            deadline = max(deadline, min(self._last_deadline, deadline + AGE_GRAIN_S))
        self._last_deadline = deadline
        if len(self.pending) >= self.limits.max_pending:
            self._evict_first("pending cap: the one nearest its hello deadline closed")
        cid = self.next_id()
        self.pending[cid] = Pending(sock, deadline)
        heapq.heappush(self._deadlines, (deadline, cid))
        if len(self._deadlines) > 2 * len(self.pending) + 64:  # entries of connections gone: compact
            self._deadlines = [(p.deadline, c) for c, p in self.pending.items()]
            heapq.heapify(self._deadlines)
        if deadline < self._sweep_at:
            self._arm(deadline)
        self._loop.add_reader(sock.fileno(), self._read, cid)

    def _pace(self, lsock: socket.socket, spent: float) -> None:
        """Under a flood: pause accepting on lsock so that the accept path's CPU time since the last pause (this
        round's and what sweeping and refusing took) is accept_share of the time until accepting again."""
        spent += self._owed
        self._owed = 0.0
        share = self.limits.accept_share
        self.counters["socket_accept_pauses"] += 1
        self._pause(lsock, min(ACCEPT_BACKOFF_MAX_S, spent * (1 - share) / share))

    def _pause(self, lsock: socket.socket, seconds: float) -> None:
        self._loop.remove_reader(lsock.fileno())

        def resume() -> None:
            self._timers.discard(timer)
            if lsock.fileno() >= 0:
                self._loop.add_reader(lsock.fileno(), self._accept, lsock)

        timer = self._loop.call_later(seconds, resume)
        self._timers.add(timer)

    def _accept_failed(self, lsock: socket.socket, e: OSError) -> None:
        """Out of descriptors: stop accepting for a backoff (doubling up to ACCEPT_BACKOFF_MAX_S) and close the older
        half of the pending connections, instead of a tight loop of failed accepts. Other errors: a short pause."""
        name = errno.errorcode.get(e.errno, e.errno)
        if e.errno in OUT_OF_FDS:
            self.counters["socket_accept_errors"] += 1
            self.refusals.note(f"accept failed ({name}), backing off")
            for _ in range(max(1, len(self.pending) // 2)):  # the flood holds them: room for new ones
                self._evict_first("evicted to free descriptors")
            self._backoff = min(max(self._backoff * 2, ACCEPT_BACKOFF_MIN_S), ACCEPT_BACKOFF_MAX_S)
        else:
            self.refusals.note(f"accept failed ({name})")
            self._backoff = ACCEPT_BACKOFF_MIN_S
        self._pause(lsock, self._backoff)

    def _read(self, cid: int) -> None:
        if not self.flooded():
            return self._read_hello(cid)
        t0 = time.thread_time()
        self._read_hello(cid)
        self._owed += time.thread_time() - t0

    def _read_hello(self, cid: int) -> None:
        """Read what is left of the hello (exactly: the length prefix, then the body), then judge it."""
        p = self.pending.get(cid)
        if p is None:
            return
        have = len(p.buf)
        try:
            need = LEN_BYTES - have if have < LEN_BYTES else \
                LEN_BYTES + frame_length(p.buf[:LEN_BYTES], HELLO_MAX_BYTES) - have
            data = p.sock.recv(need)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, FrameError):
            return self._refuse(cid, "no valid token")
        if not data:  # closed before its hello
            return self._refuse(cid, "no valid token")
        p.buf += data
        if len(p.buf) < LEN_BYTES:
            return
        try:
            n = frame_length(p.buf[:LEN_BYTES], HELLO_MAX_BYTES)
            if len(p.buf) < LEN_BYTES + n:
                return
            hello = parse_frame(p.buf[LEN_BYTES:])
        except FrameError:
            return self._refuse(cid, "no valid token")
        ep = self.endpoint()
        if hello[0] != Frame.HELLO or len(hello) != 2 or ep is None or not ep.accepts(hello[1]):
            return self._refuse(cid, "no valid token")
        del self.pending[cid]
        self._loop.remove_reader(p.sock.fileno())
        # an accepted socket's proto is 0, so asyncio would not set TCP_NODELAY itself (small frames would wait for
        # delayed ACKs: 40 ms a stream); set at the hello, not the accept: a flood's connections never need it
        p.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.on_hello(cid, p.sock)

    def _arm(self, at: float) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._sweep_at = at
        self._sweeper = self._loop.call_at(at, self._sweep)

    def _first(self) -> int | None:
        """The pending connection nearest its deadline (entries of connections gone dropped on the way)."""
        while self._deadlines:
            deadline, cid = self._deadlines[0]
            if cid in self.pending:
                return cid
            heapq.heappop(self._deadlines)
        return None

    def _sweep(self) -> None:
        """Close the pending connections at or past their hello deadline; the timer again at the next deadline."""
        t0 = time.thread_time() if self.paced else 0.0
        self._sweeper, self._sweep_at = None, float("inf")
        now = self._loop.time()
        while (cid := self._first()) is not None and self.pending[cid].deadline <= now:
            self.counters["socket_hello_timeouts"] += 1
            self._refuse(cid, f"no hello within {self.limits.hello_timeout_s:g}s")
        if cid is not None:
            self._arm(max(self.pending[cid].deadline, now + SWEEP_GAP_S))
        if self.flooded():
            self._owed += time.thread_time() - t0

    def _evict_first(self, why: str) -> None:
        if (cid := self._first()) is not None:
            self.counters["socket_refused_cap"] += 1
            self._refuse(cid, why)

    def _refuse(self, cid: int, why: str) -> None:
        self.counters["socket_refused"] += 1
        self.refusals.note(why)
        self._drop(cid, refused=True)

    def _drop(self, cid: int, refused: bool = False) -> None:
        p = self.pending.pop(cid)
        if p.sock.fileno() >= 0:
            self._loop.remove_reader(p.sock.fileno())
        if refused:
            self._close_refused(p.sock)
        else:
            p.sock.close()

    def _close_refused(self, sock: socket.socket) -> None:
        if self.limits.refuse_reset and sock.fileno() >= 0:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
            except OSError:  # already reset by the peer: a plain close
                pass
        sock.close()
