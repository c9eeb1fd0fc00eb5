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
from collections.abc import AsyncIterator, Callable

import ray
from ray.exceptions import RayActorError, RayError

from flame_llm.protocol.stream_frames import (
    FRAME_OVERHEAD,
    Frame,
    FrameError,
    StreamEndpoint,
    encode_frame,
    keepalive,
    read_frame,
)
from flame_llm.protocol.types import MAX_RESULT_PAYLOAD_BYTES
from flame_llm.serving.pending import ClientCounters

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 10.0


class StreamFailed(RuntimeError):
    """The shard could not serve a stream or batch (a FAIL frame: a bug on the shard)."""


class StreamConn:
    """One connection to one shard incarnation's stream server; its streams by id."""

    def __init__(self, shard: int, endpoint: StreamEndpoint, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, on_lost: Callable[[RayActorError], None] | None = None) -> None:
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
                self.on_lost(self.lost())

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


class ShardLink:
    """A shard's connection to its current incarnation, made on first use and again after the shard restarted (its
    ShardChannel, channel.py, is one). `watch_loss` hears of a connection the shard's side ended."""

    def __init__(self, shard: int, actors: dict[int, ray.actor.ActorHandle], counters: ClientCounters,
                 caller: str | None, client_id: str | None) -> None:
        """actors: the client's (a replacement's handle lands there); caller, client_id: the client's Ray job and
        id, sent with each stream and batch."""
        self.shard, self.actors, self.counters, self.caller, self.client_id = shard, actors, counters, caller, client_id
        self.conn: StreamConn | None = None  # to the shard's current incarnation, once made
        self._connecting: asyncio.Future | None = None
        self.connects: set[asyncio.Task] = set()

    def watch_loss(self, e: BaseException) -> None:
        """The shard's side ended the connection (the shard likely died): the channel's to act on."""

    async def connection(self) -> StreamConn:
        """The connection to the shard's current incarnation, made on first use (one connect, shared)."""
        if self.conn is not None and self.conn.broken is None:
            return self.conn
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())

            def over(f: asyncio.Future) -> None:
                self._connecting = None
                if not f.cancelled():
                    f.exception()  # retrieved: each waiter raises it (none may be left)

            self._connecting.add_done_callback(over)
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> StreamConn:
        # this node's id: a shard on it answers its loopback address (actors/engine_actor.py stream_endpoint)
        node = ray.get_runtime_context().get_node_id()
        ep: StreamEndpoint = await self.actors[self.shard].stream_endpoint.remote(node)  # RayActorError: dead
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(ep.host, ep.port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            raise RayActorError(error_msg=f"shard {self.shard}'s stream server at {ep.host}:{ep.port} does not "
                                          f"answer: {type(e).__name__}: {e}") from None
        keepalive(writer.get_extra_info("socket"))
        writer.write(encode_frame(Frame.HELLO, ep.token))
        self.conn = StreamConn(self.shard, ep, reader, writer, self.watch_loss)
        log.debug("shard %d: connection to %s:%d", self.shard, ep.host, ep.port)
        return self.conn

    def keep_connected(self) -> None:
        """Open the connection now (and again after each restart: ShardWatch), whether or not a request uses it:
        when the shard's process dies its connection ends, and the client routes around it at once."""
        async def quietly() -> None:
            try:
                await self.connection()
            except (RayError, OSError, asyncio.TimeoutError):  # dead now: its requests find out
                pass

        task = asyncio.get_running_loop().create_task(quietly())
        self.connects.add(task)
        task.add_done_callback(self.connects.discard)

    def drop_conn(self, why: str, keep: str | None = None) -> None:
        """The shard is a new incarnation: the old connection (broken with it) goes. keep: the incarnation that
        answers now; a connection already made to it stays (a stream sent since the restart runs on it)."""
        if self.conn is not None and self.conn.endpoint.incarnation != keep:
            conn, self.conn = self.conn, None
            conn.close(why)

    async def close(self) -> None:
        """The client goes: its connection closes (the shard ends what is left on it)."""
        for t in list(self.connects):
            t.cancel()
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close("the client closed")
        await asyncio.gather(*self.connects, *([conn.reader] if conn is not None else []), return_exceptions=True)

    async def stream_items(self, payload: bytes) -> AsyncIterator[list[int] | bytes]:
        """One stream on the shard: lists of token ids, then the result payload. RayActorError when the connection
        cannot be made or breaks; closed before its result (cancelled), the shard is told to abort it."""
        conn = await self.connection()
        sid, q = conn.open(payload, self.caller, self.client_id)
        item = None
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, bytes):
                    return
        except (asyncio.CancelledError, GeneratorExit):  # cancelled, or closed before its result: abort it there
            if not isinstance(item, bytes):
                self.counters.aborts_sent += 1
                conn.cancel(sid)
            raise
        finally:
            conn.done(sid)
