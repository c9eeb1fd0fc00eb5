"""One stream connection's outgoing frames (actors/stream_server.py; issues 37 and 39): coalesced and bounded.

Coalescing (ShardOptions.stream_coalesce, on by default): the frames the connection's streams produce within one
turn of the event loop (one engine step's tokens reach every stream of the step in the same turn) are queued and
leave as one transport write at the end of that turn: the bytes of the frames one after another, exactly the bytes
the frames would be written as one by one (flame_llm/protocol/stream_frames.py: each frame is length-prefixed, so
the client's reader does not see the difference). Off, every frame is its own write, as before.

Bound: a connection's unsent bytes (queued here plus the transport's buffer) above `stream_max_unsent_bytes`
(1 MiB) make the stream that wrote last wait for the peer to read; a peer that does not read within
`stream_drain_timeout_s` (30 s) is cut off: the connection is aborted, which ends its streams (the server aborts
their engine requests as for any closed connection); other connections are not affected.

Counted in the server's counters (the shard's stats): socket_out_frames, socket_out_writes, socket_out_bytes,
socket_cutoffs."""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


class CutOff(ConnectionError):
    """The peer did not read its frames within the drain deadline: the connection was aborted."""


class StreamOut:
    """The outgoing side of one stream connection over `writer` (an asyncio StreamWriter)."""

    __slots__ = ("writer", "transport", "counters", "coalesce", "max_unsent", "drain_s", "queued", "queued_bytes",
                 "cut", "_loop", "_scheduled")

    def __init__(self, writer: asyncio.StreamWriter, counters: dict[str, int], coalesce: bool, max_unsent_bytes: int,
                 drain_timeout_s: float) -> None:
        self.writer, self.transport, self.counters = writer, writer.transport, counters
        self.coalesce, self.max_unsent, self.drain_s = coalesce, max_unsent_bytes, drain_timeout_s
        self.queued: list[bytes] = []  # frames of this loop turn, not yet written
        self.queued_bytes = 0
        self.cut = False
        self._loop = asyncio.get_running_loop()
        self._scheduled = False

    def send(self, frame: bytes) -> None:
        """Queue one encoded frame (coalescing: it leaves with this turn's others; else at once)."""
        if self.cut or self.transport.is_closing():
            return
        c = self.counters
        c["socket_out_frames"] += 1
        c["socket_out_bytes"] += len(frame)
        if not self.coalesce:
            c["socket_out_writes"] += 1
            self.transport.write(frame)
            return
        self.queued.append(frame)
        self.queued_bytes += len(frame)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write what this turn queued, as one write."""
        self._scheduled = False
        if not self.queued:
            return
        data = self.queued[0] if len(self.queued) == 1 else b"".join(self.queued)
        self.queued.clear()
        self.queued_bytes = 0
        if self.cut or self.transport.is_closing():
            return
        self.counters["socket_out_writes"] += 1
        self.transport.write(data)

    def unsent(self) -> int:
        return self.queued_bytes + self.transport.get_write_buffer_size()

    async def room(self) -> None:
        """Return when the connection's unsent bytes are within the bound; a peer that does not read them within
        the drain deadline is cut off (CutOff). Coalescing off and within the bound, it waits as before for the
        transport's own flow control (StreamWriter.drain)."""
        if self.unsent() <= self.max_unsent:
            if not self.coalesce:
                await self.writer.drain()  # before: every frame awaited it (returns at once unless paused)
            return
        self.flush()
        try:
            async with asyncio.timeout(self.drain_s):
                while self.unsent() > self.max_unsent and not self.cut:
                    await self.writer.drain()  # wakes at the transport's low-water mark, or raises when it closed
        except TimeoutError:
            self.cut_off()
        if self.cut:
            raise CutOff(f"the peer did not read its frames (over stream_max_unsent_bytes {self.max_unsent}) within "
                         f"stream_drain_timeout_s ({self.drain_s:g}s)")

    def cut_off(self) -> None:
        """Abort the connection: its reader ends, and the server ends the connection's streams."""
        if self.cut:
            return
        self.cut = True
        self.counters["socket_cutoffs"] += 1
        log.warning("stream connection cut off: %d bytes unsent (over %d) past stream_drain_timeout_s (%gs)",
                    self.unsent(), self.max_unsent, self.drain_s)
        self.queued.clear()
        self.queued_bytes = 0
        self.transport.abort()
