"""The client's end of the socket transport: one persistent TCP connection to a shard incarnation's stream server
(actors/stream_server.py; framing in flame_llm/protocol/stream_frames.py), carrying its streams and batches; its
shard's ShardChannel (channel.py) opens it from the endpoint the actor's `stream_endpoint` call gives, and again from
a fresh endpoint once it broke (the shard died or restarted). A reader task routes each frame to the stream (or
batch) it belongs to. Lives on the client's event loop.

A connection that breaks under a stream raises what Ray raises when an actor dies under a call (RayActorError), so
that the one retry policy (retry.py) treats both alike. A connection the shard's side ends, with or without streams
on it, is also reported (`on_lost`): the shard's process is gone within milliseconds of its death, so new requests
go around it from then on instead of waiting out its restart."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ray.exceptions import RayActorError

from flame_llm.protocol.stream_frames import (
    FRAME_OVERHEAD,
    Frame,
    FrameError,
    StreamEndpoint,
    encode_frame,
    read_frame,
)
from flame_llm.protocol.types import MAX_RESULT_PAYLOAD_BYTES

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 10.0


class StreamFailed(RuntimeError):
    """The shard could not serve a stream or batch (a FAIL frame: a bug on the shard)."""


class StreamConn:
    """One connection to one shard incarnation's stream server; its streams by id."""

    def __init__(self, shard: int, endpoint: StreamEndpoint, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, on_lost: Callable[[int, RayActorError], None] | None = None) -> None:
        self.shard, self.endpoint, self.writer, self.on_lost = shard, endpoint, writer, on_lost
        self.streams: dict[int, asyncio.Queue] = {}  # stream id -> its frames' items, in order
        self.next_sid = 0
        self.broken: str | None = None  # why the connection is unusable (then no stream is left on it)
        self.reader = asyncio.get_running_loop().create_task(self._read(reader))
        # the server closes a connection with no stream and no frame for idle_timeout_s: a ping at a third of it
        self.pinger = asyncio.get_running_loop().create_task(self._ping(endpoint.idle_timeout_s / 3)) \
            if endpoint.idle_timeout_s > 0 else None

    def lost(self) -> RayActorError:
        ep = self.endpoint
        return RayActorError(error_msg=f"the stream connection to shard {self.shard} ({ep.host}:{ep.port}, "
                                       f"incarnation {ep.incarnation[:8]}) broke: {self.broken}")

    def open(self, payload: bytes, caller: str | None, client: str | None, kind: Frame = Frame.OPEN
             ) -> tuple[int, asyncio.Queue]:
        """Send a stream's (kind BATCH: a batch's) request payload; (its id, the queue its items arrive in: token
        id lists, result payloads, or the exception that ended it). Its reader says when it is done (`done`)."""
        if self.broken is not None:
            raise self.lost()
        sid, self.next_sid = self.next_sid, self.next_sid + 1
        q = self.streams[sid] = asyncio.Queue()
        self.writer.write(encode_frame(kind, sid, payload, caller, client))
        return sid, q

    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests of this connection's batches on the shard (when the connection is gone, it has)."""
        if self.broken is None:
            self.writer.write(encode_frame(Frame.ABORT, request_ids))

    def cancel(self, sid: int) -> None:
        """The caller left: the shard aborts the stream (when the connection is gone, it has already)."""
        if self.streams.pop(sid, None) is not None and self.broken is None:
            self.writer.write(encode_frame(Frame.CANCEL, sid))

    def done(self, sid: int) -> None:
        self.streams.pop(sid, None)

    def close(self, why: str) -> None:
        self._break(why)
        self.reader.cancel()

    async def _ping(self, every_s: float) -> None:
        while self.broken is None:
            await asyncio.sleep(every_s)
            if self.broken is None:
                self.writer.write(encode_frame(Frame.PING))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "closed by the shard"
        try:
            while (frame := await read_frame(reader, MAX_RESULT_PAYLOAD_BYTES + FRAME_OVERHEAD)) is not None:
                kind, sid = frame[0], frame[1] if len(frame) == 3 else None
                q = self.streams.get(sid) if kind in (Frame.CHUNK, Frame.RESULT, Frame.FAIL) else None
                if q is None:  # a stream this side cancelled: its last frames are dropped
                    if sid is None or not isinstance(sid, int) or sid >= self.next_sid:
                        raise FrameError(f"unexpected frame {str(frame)[:80]}")
                    continue
                if kind in (Frame.CHUNK, Frame.RESULT):  # a batch has several RESULT frames: its reader counts
                    q.put_nowait(frame[2])
                else:
                    self.streams.pop(sid)
                    q.put_nowait(StreamFailed(f"shard {self.shard} could not serve the stream: {frame[2]}"))
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: its loop went with the task pending
            why = "closed by the client"
            raise
        except (FrameError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            why = f"{type(e).__name__}: {e}"
        finally:
            by_peer = self.broken is None and why != "closed by the client"  # not by close(): the client's own
            self._break(why)
            if by_peer and self.on_lost is not None:
                self.on_lost(self.shard, self.lost())

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            if self.streams:
                log.warning("shard %d: stream connection broke with %d streams open: %s", self.shard,
                            len(self.streams), why)
            for q in self.streams.values():
                q.put_nowait(self.lost())
            self.streams.clear()
            try:
                if self.pinger is not None:
                    self.pinger.cancel()
                self.writer.close()
            except RuntimeError:  # its loop closed first (a client dropped without close()): nothing to tell
                pass
