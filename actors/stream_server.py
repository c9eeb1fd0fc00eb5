"""An engine actor's stream server (ClientConfig.stream_transport = "socket"): a TCP server on the actor's own
event loop, bound to its node's IP on an ephemeral port, carrying streams without a Ray call per request or per
chunk (flame_llm/protocol/stream_frames.py says the framing). Each stream is served by the same async generator
as the actor's Ray `stream` method (EngineActor.stream_items): token chunks, then the result payload.

A connection presents the actor's secret token first, or it is closed. A stream ends on its shard when its
client cancels it or when its connection closes (the caller is gone, as the dead-caller watcher decides for Ray
callers): its task is cancelled, and the actor aborts its request as `EngineActor.abort` would (counted in the
shard's "aborted"), which frees its admission slot."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from flame_llm.protocol.stream_frames import (
    FRAME_OVERHEAD,
    HELLO_MAX_BYTES,
    Frame,
    FrameError,
    StreamEndpoint,
    encode_frame,
    keepalive,
    read_frame,
)

log = logging.getLogger(__name__)

Items = Callable[[bytes, "str | None", "str | None"], AsyncIterator["list[int] | bytes"]]


class StreamServer:
    def __init__(self, items: Items, max_payload_bytes: int, name: str, incarnation: str) -> None:
        self.items, self.name, self.incarnation = items, name, incarnation
        # a request payload is zstd of at most max_payload_bytes (incompressible input grows a little)
        self.max_frame_bytes = max_payload_bytes + max_payload_bytes // 64 + FRAME_OVERHEAD
        self.server: asyncio.base_events.Server | None = None
        self.endpoint: StreamEndpoint | None = None
        self._starting: asyncio.Future | None = None
        self.conns: set[asyncio.Task] = set()
        self.counters = {"socket_connections": 0, "socket_refused": 0, "socket_streams": 0, "socket_cancels": 0,
                         "socket_dropped": 0}

    async def start(self, host: str) -> StreamEndpoint:
        """Listen on host (an ephemeral port), on the running loop, once; the endpoint clients connect to."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start(host))
        return await asyncio.shield(self._starting)

    async def _start(self, host: str) -> StreamEndpoint:
        self.server = await asyncio.start_server(self._serve_conn, host, 0)
        port = self.server.sockets[0].getsockname()[1]
        self.endpoint = StreamEndpoint(host, port, StreamEndpoint.new_token(), self.incarnation)
        log.info("shard %s: stream server on %s:%d", self.name, host, port)
        return self.endpoint

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self.conns):
            t.cancel()
        await asyncio.gather(*self.conns, return_exceptions=True)

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.conns.add(asyncio.current_task())
        keepalive(writer.get_extra_info("socket"))
        streams: dict[int, asyncio.Task] = {}
        try:
            try:
                hello = await read_frame(reader, HELLO_MAX_BYTES)
            except FrameError:
                hello = None
            if hello is None or hello[0] != Frame.HELLO or len(hello) != 2 or not self.endpoint.accepts(hello[1]):
                self.counters["socket_refused"] += 1
                log.warning("shard %s: stream connection from %s refused (no valid token)", self.name,
                            writer.get_extra_info("peername"))
                return
            self.counters["socket_connections"] += 1
            while (frame := await read_frame(reader, self.max_frame_bytes)) is not None:
                kind = frame[0]
                if kind == Frame.OPEN and len(frame) == 5 and isinstance(frame[1], int) \
                        and isinstance(frame[2], bytes) and frame[1] not in streams:
                    sid, payload, caller, client = frame[1:]
                    caller, client = (x if isinstance(x, str) else None for x in (caller, client))
                    self.counters["socket_streams"] += 1
                    task = asyncio.get_running_loop().create_task(self._stream(writer, sid, payload, caller, client))
                    streams[sid] = task
                    task.add_done_callback(lambda _, sid=sid: streams.pop(sid, None))
                elif kind == Frame.CANCEL and len(frame) == 2:
                    task = streams.pop(frame[1], None)
                    if task is not None:
                        self.counters["socket_cancels"] += 1
                        task.cancel()
                else:
                    raise FrameError(f"unexpected frame {str(frame)[:80]}")
        except (FrameError, asyncio.IncompleteReadError, ConnectionError) as e:
            log.warning("shard %s: stream connection closed: %s: %s", self.name, type(e).__name__, e)
        finally:
            if streams:  # the connection is gone, and with it whoever would read these streams
                self.counters["socket_dropped"] += len(streams)
                log.warning("shard %s: a stream connection closed with %d streams open: aborting them", self.name,
                            len(streams))
            for task in list(streams.values()):
                task.cancel()
            await asyncio.gather(*streams.values(), return_exceptions=True)
            writer.close()
            self.conns.discard(asyncio.current_task())

    async def _stream(self, writer: asyncio.StreamWriter, sid: int, payload: bytes, caller: str | None,
                      client: str | None) -> None:
        try:
            async with aclosing(self.items(payload, caller, client)) as items:  # closed at once when cancelled
                async for item in items:
                    kind = Frame.CHUNK if isinstance(item, list) else Frame.RESULT
                    writer.write(encode_frame(kind, sid, item))
                    await writer.drain()
        except ConnectionError:  # the connection went: _serve_conn aborts what is left of its streams
            return
        except Exception as e:  # a bug: the client must not wait forever (the Ray path raises it to the caller)
            log.exception("shard %s: stream %d failed", self.name, sid)
            if not writer.is_closing():
                writer.write(encode_frame(Frame.FAIL, sid, f"{type(e).__name__}: {e}"))
