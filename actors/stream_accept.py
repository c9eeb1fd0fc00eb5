"""The stream server's accepting and its connections before their hello (issue 37), as bare sockets: no asyncio
StreamReader, StreamWriter or task per pending connection, so that a flood of silent connections costs the actor a
descriptor and a few bytes each, and little CPU.

- Each listening socket is a reader callback of the loop that accepts up to ACCEPT_BATCH connections a turn.
- A pending connection's socket is a reader callback that reads exactly its hello frame (never a byte past it: the
  connection's next frames stay in the kernel for the asyncio stream that serves it after), then hands the socket
  to `on_hello` (the server's) with the token checked.
- One periodic sweep (every SWEEP_FRACTION of the hello deadline, within SWEEP_MIN_S..SWEEP_MAX_S) closes the
  pending connections past their deadline: the oldest first, as they are kept in accept order.

The bounds and their refusal log are actors/stream_guard.py's, as before: the hello deadline, at most max_pending
connections pending (one more closes the oldest), accept backing off when the process is out of descriptors (and the
older half of the pending connections closed)."""
from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable

from actors.stream_guard import ACCEPT_BACKOFF_MAX_S, ACCEPT_BACKOFF_MIN_S, RefusalLog, StreamLimits
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
SWEEP_FRACTION, SWEEP_MIN_S, SWEEP_MAX_S = 0.25, 0.05, 1.0
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Pending:
    """A connection before its hello: its socket, its deadline (loop time), the hello's bytes read so far."""

    __slots__ = ("sock", "deadline", "buf")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.buf = sock, deadline, b""


class Acceptor:
    """Accepts on the server's listening sockets and holds the connections before their hello (by id, oldest
    first). on_hello(cid, sock): a connection presented the token (its socket is the caller's from then)."""

    def __init__(self, limits: StreamLimits, counters: dict[str, int], refusals: RefusalLog,
                 endpoint: Callable[[], StreamEndpoint | None], on_hello: Callable[[int, socket.socket], None],
                 next_id: Callable[[], int]) -> None:
        self.limits, self.counters, self.refusals = limits, counters, refusals
        self.endpoint, self.on_hello, self.next_id = endpoint, on_hello, next_id
        self.pending: dict[int, Pending] = {}
        self.listeners: list[socket.socket] = []
        self._loop = asyncio.get_running_loop()
        self._backoff = 0.0
        self._timers: set[asyncio.TimerHandle] = set()
        self._sweep_s = min(SWEEP_MAX_S, max(SWEEP_MIN_S, SWEEP_FRACTION * limits.hello_timeout_s))
        self._sweeper = self._loop.call_later(self._sweep_s, self._sweep)

    def listen(self, lsock: socket.socket) -> None:
        lsock.setblocking(False)
        self.listeners.append(lsock)
        self._loop.add_reader(lsock.fileno(), self._accept, lsock)

    def close(self) -> None:
        self._sweeper.cancel()
        for t in self._timers:
            t.cancel()
        for lsock in self.listeners:
            if lsock.fileno() >= 0:
                self._loop.remove_reader(lsock.fileno())
                lsock.close()
        for cid in list(self.pending):
            self._drop(cid)

    def _accept(self, lsock: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._accept_failed(lsock, e)
                return
            self._backoff = 0.0
            sock.setblocking(False)
            # an accepted socket's proto is 0, so asyncio would not set TCP_NODELAY itself (small frames would wait
            # for delayed ACKs: 40 ms a stream)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(self.pending) >= self.limits.max_pending:
                self._evict_oldest("pending cap: oldest without hello closed")
            cid = self.next_id()
            self.pending[cid] = Pending(sock, self._loop.time() + self.limits.hello_timeout_s)
            self._loop.add_reader(sock.fileno(), self._read, cid)

    def _accept_failed(self, lsock: socket.socket, e: OSError) -> None:
        """Out of descriptors: stop accepting for a backoff (doubling up to ACCEPT_BACKOFF_MAX_S) and close the older
        half of the pending connections, instead of a tight loop of failed accepts. Other errors: a short pause."""
        name = errno.errorcode.get(e.errno, e.errno)
        if e.errno in OUT_OF_FDS:
            self.counters["socket_accept_errors"] += 1
            self.refusals.note(f"accept failed ({name}), backing off")
            for _ in range(max(1, len(self.pending) // 2)):  # the flood holds them: room for new ones
                self._evict_oldest("evicted to free descriptors")
            self._backoff = min(max(self._backoff * 2, ACCEPT_BACKOFF_MIN_S), ACCEPT_BACKOFF_MAX_S)
        else:
            self.refusals.note(f"accept failed ({name})")
            self._backoff = ACCEPT_BACKOFF_MIN_S
        self._loop.remove_reader(lsock.fileno())

        def resume() -> None:
            self._timers.discard(timer)
            if lsock.fileno() >= 0:
                self._loop.add_reader(lsock.fileno(), self._accept, lsock)

        timer = self._loop.call_later(self._backoff, resume)
        self._timers.add(timer)

    def _read(self, cid: int) -> None:
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
        self.on_hello(cid, p.sock)

    def _sweep(self) -> None:
        """Close the pending connections past their hello deadline (the oldest are first)."""
        now = self._loop.time()
        while self.pending:
            cid, p = next(iter(self.pending.items()))
            if p.deadline > now:
                break
            self.counters["socket_hello_timeouts"] += 1
            self._refuse(cid, f"no hello within {self.limits.hello_timeout_s:g}s")
        self._sweeper = self._loop.call_later(self._sweep_s, self._sweep)

    def _evict_oldest(self, why: str) -> None:
        if self.pending:
            self.counters["socket_refused_cap"] += 1
            self._refuse(next(iter(self.pending)), why)

    def _refuse(self, cid: int, why: str) -> None:
        self.counters["socket_refused"] += 1
        self.refusals.note(why)
        self._drop(cid)

    def _drop(self, cid: int) -> None:
        p = self.pending.pop(cid)
        if p.sock.fileno() >= 0:
            self._loop.remove_reader(p.sock.fileno())
        p.sock.close()
