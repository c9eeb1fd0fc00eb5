"""The client's end of the socket stream transport: one persistent TCP
connection per shard incarnation to its engine actor's stream server (actors/stream_server.py; framing in
flame_llm/protocol/stream_frames.py), opened on first use from the endpoint the actor's `stream_endpoint` call
gives, and again from a fresh endpoint once the connection broke (the shard died or restarted). A reader task
routes each frame to the stream it belongs to. Lives on the client's event loop.

A connection that breaks under a stream raises what the Ray transport raises when a shard dies under it
(RayActorError), so that the one retry policy (retry.py) treats both transports alike. A connection the shard's
side ends, with or without streams on it, is also reported (`on_lost`): the shard's process is gone within
milliseconds of its death, so new requests go around it from then on instead of waiting out its restart."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import ray
from ray.exceptions import RayActorError

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
from flame_llm.serving.batcher import ClientCounters

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 10.0


class StreamFailed(RuntimeError):
    """The shard could not serve a stream (a FAIL frame: a bug on the shard, as the Ray transport would raise)."""


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

    def open(self, payload: bytes, caller: str | None, client: str | None) -> tuple[int, asyncio.Queue]:
        """Send a stream's request payload; (its id, the queue its items arrive in)."""
        if self.broken is not None:
            raise self.lost()
        sid, self.next_sid = self.next_sid, self.next_sid + 1
        q = self.streams[sid] = asyncio.Queue()
        self.writer.write(encode_frame(Frame.OPEN, sid, payload, caller, client))
        return sid, q

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
                if kind == Frame.CHUNK:
                    q.put_nowait(frame[2])
                elif kind == Frame.RESULT:
                    self.streams.pop(sid)
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


class StreamConns:
    """The client's connections, one per shard (to its current incarnation), made on first use."""

    def __init__(self, actors: dict[int, ray.actor.ActorHandle], counters: ClientCounters,
                 on_lost: Callable[[int, RayActorError], None] | None = None) -> None:
        self.actors, self.counters = actors, counters  # actors: the dispatcher's (a replacement's handle lands)
        self.on_lost = on_lost  # (shard, error): a connection its shard's side ended (the shard likely died)
        self.conns: dict[int, StreamConn] = {}
        self._connecting: dict[int, asyncio.Future] = {}

    async def items(self, shard: int, payload: bytes, caller: str | None, client: str | None
                    ) -> AsyncIterator[list[int] | bytes]:
        """One stream on the shard: lists of token ids, then the result payload (as EngineActor.stream_items yields).
        RayActorError when the connection cannot be made or breaks; cancelled, the shard is told to abort it."""
        conn = await self.get(shard)
        sid, q = conn.open(payload, caller, client)
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

    async def get(self, shard: int) -> StreamConn:
        conn = self.conns.get(shard)
        if conn is not None and conn.broken is None:
            return conn
        fut = self._connecting.get(shard)
        if fut is None:  # one connect per shard, whoever asks meanwhile waits for it
            fut = self._connecting[shard] = asyncio.ensure_future(self._connect(shard))

            def over(f: asyncio.Future) -> None:
                self._connecting.pop(shard, None)
                if not f.cancelled():
                    f.exception()  # retrieved: each waiter raises it (none may be left)

            fut.add_done_callback(over)
        return await asyncio.shield(fut)

    async def _connect(self, shard: int) -> StreamConn:
        # this node's id: a shard on it answers its loopback address (actors/engine_actor.py stream_endpoint)
        node = ray.get_runtime_context().get_node_id()
        endpoint: StreamEndpoint = await self.actors[shard].stream_endpoint.remote(node)  # RayActorError: it is dead
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(endpoint.host, endpoint.port),
                                                    CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            raise RayActorError(error_msg=f"shard {shard}'s stream server at {endpoint.host}:{endpoint.port} does "
                                          f"not answer: {type(e).__name__}: {e}") from None
        keepalive(writer.get_extra_info("socket"))
        writer.write(encode_frame(Frame.HELLO, endpoint.token))
        conn = self.conns[shard] = StreamConn(shard, endpoint, reader, writer, self.on_lost)
        log.debug("shard %d: stream connection to %s:%d", shard, endpoint.host, endpoint.port)
        return conn

    def drop(self, shard: int, why: str, keep: str | None = None) -> None:
        """The shard is a new incarnation: its old connection (broken with it) goes. keep: the incarnation that
        answers now; a connection already made to it stays (a stream sent since the restart runs on it)."""
        conn = self.conns.get(shard)
        if conn is not None and conn.endpoint.incarnation != keep:
            del self.conns[shard]
            conn.close(why)

    async def close(self) -> None:
        conns, self.conns = list(self.conns.values()), {}
        for c in conns:
            c.close("the client closed")
        await asyncio.gather(*(c.reader for c in conns), return_exceptions=True)
