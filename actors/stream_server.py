"""An engine actor's stream server: a TCP server on the actor's own
event loop, on an ephemeral port of the loopback address (a client on the actor's node) or of the node's address
(once a client on another node asks: a multi-node cluster), carrying streams without a Ray call per request or per
chunk (flame_llm/protocol/stream_frames.py says the framing). Each stream is served by the actor's async
generator EngineActor.stream_items: token chunks, then the result payload; a batch by the same generator: its result
payloads as its requests finish. An ABORT frame aborts requests of the connection's batches by id.

A connection presents the actor's secret token first, or it is closed. A stream ends on its shard when its
client cancels it or when its connection closes (the caller is gone: its process died, or its node, noticed by
TCP keepalive): its task is cancelled, and the actor aborts its request as an ABORT frame would (counted in the
shard's "aborted"), which frees its admission slot. Every wait of a connection is bounded (actors/stream_guard.py);
a bad frame after the hello closes only what it must: an OPEN or CANCEL whose fields are unusable is refused alone
(counted in socket_bad_frames; an OPEN with a usable new stream id is answered FAIL), a frame that breaks the
framing closes its connection. Accepting and the connections before their hello are actors/stream_accept.py's (bare
sockets); a connection's outgoing frames are actors/stream_out.py's (coalesced a loop turn, unsent bytes bounded)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import ray

from actors.shard_options import ShardOptions
from actors.stream_accept import Acceptor
from actors.stream_guard import RefusalLog, StreamLimits
from actors.stream_out import CutOff, StreamOut
from flame_llm.protocol.stream_frames import (
    FRAME_OVERHEAD,
    Frame,
    FrameError,
    FrameIdle,
    StreamEndpoint,
    encode_frame,
    keepalive,
    read_frame_within,
)

log = logging.getLogger(__name__)

Items = Callable[[bytes, "str | None", "str | None", "str | None"], AsyncIterator["list[int] | bytes"]]
Abort = Callable[[list[str], str], int]
LOOPBACK = "127.0.0.1"
COUNTERS = ("socket_connections", "socket_refused", "socket_streams", "socket_batches", "socket_cancels",
            "socket_dropped", "socket_hello_timeouts", "socket_refused_cap", "socket_idle_closed",
            "socket_frame_timeouts", "socket_bad_frames", "socket_accept_errors", "socket_out_frames",
            "socket_out_writes", "socket_out_bytes", "socket_cutoffs", "socket_accept_pauses")


async def stream_host(client_node: str | None, node_id: str, name: str) -> str:
    """The address shard `name` (on node_id) serves a client on `client_node` at: loopback for a client on its node
    (or, unnamed, any client of a one-node cluster), else the node's address (a multi-node cluster). Logged."""
    if client_node is None:
        nodes = await asyncio.to_thread(lambda: sum(n["Alive"] for n in ray.nodes()))
        local, why = nodes <= 1, f"a client on an unnamed node; the cluster has {nodes} node(s)"
    else:
        local, why = client_node == node_id, f"a client on node {client_node[:8]}"
    host = LOOPBACK if local else ray.util.get_node_ip_address()
    log.info("shard %s: stream port on %s for %s", name,
             "loopback" if local else f"the node's address {host} (a multi-node cluster)", why)
    return host


class StreamServer:
    def __init__(self, items: Items, max_payload_bytes: int, name: str, incarnation: str,
                 limits: StreamLimits | None = None, abort: Abort | None = None) -> None:
        """items(payload, caller, client, owner[, batch=True]): a stream's (or a batch's) items; abort(ids, owner):
        an ABORT frame's requests (EngineActor's)."""
        self.items, self.name, self.incarnation, self.abort = items, name, incarnation, abort
        self.limits = limits if limits is not None else ShardOptions().stream_limits()
        # a request payload is zstd of at most max_payload_bytes (incompressible input grows a little)
        self.max_frame_bytes = max_payload_bytes + max_payload_bytes // 64 + FRAME_OVERHEAD
        self.token = StreamEndpoint.new_token()  # one per incarnation, whichever address a client comes by
        self.endpoints: dict[str, StreamEndpoint] = {}  # host -> where it listens
        self._starting: dict[str, asyncio.Future] = {}
        self.authed: dict[int, asyncio.Task] = {}  # connections past their hello: the task serving each
        self._ids = itertools.count()
        self.refusals = RefusalLog(log, name)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.acceptor: Acceptor | None = None  # on the loop of the first start()

    @property
    def pending(self) -> dict:
        """The connections before their hello, oldest first (bare sockets: actors/stream_accept.py)."""
        return self.acceptor.pending if self.acceptor is not None else {}

    @property
    def endpoint(self) -> StreamEndpoint | None:
        return next(iter(self.endpoints.values()), None)

    async def start(self, host: str) -> StreamEndpoint:
        """Listen on host (an ephemeral port), on the running loop, once per host; the endpoint clients connect to."""
        if host not in self._starting:
            self._starting[host] = asyncio.ensure_future(self._start(host))
        return await asyncio.shield(self._starting[host])

    async def _start(self, host: str) -> StreamEndpoint:
        lsock = socket.create_server((host, 0), backlog=1024)
        if self.acceptor is None:
            self.acceptor = Acceptor(self.limits, self.counters, self.refusals, lambda: self.endpoint, self._hello,
                                     lambda: next(self._ids))
        self.acceptor.listen(lsock)
        port = lsock.getsockname()[1]
        ep = self.endpoints[host] = StreamEndpoint(host, port, self.token, self.incarnation,
                                                   self.limits.idle_timeout_s)
        log.info("shard %s: stream server on %s:%d", self.name, host, port)
        return ep

    async def stop(self) -> None:
        if self.acceptor is not None:
            self.acceptor.close()
        conns = list(self.authed.values())
        for t in conns:
            t.cancel()
        await asyncio.gather(*conns, return_exceptions=True)
        self.refusals.close()

    def _hello(self, cid: int, sock: socket.socket) -> None:
        """A connection presented the token (actors/stream_accept.py): served, unless the connection cap is
        reached."""
        if len(self.authed) >= self.limits.max_connections:
            self.counters["socket_refused_cap"] += 1
            self.refusals.note(f"connection cap ({self.limits.max_connections}) reached")
            sock.close()
            return
        self.counters["socket_connections"] += 1
        task = self.authed[cid] = asyncio.get_running_loop().create_task(self._serve_conn(cid, sock))
        task.add_done_callback(lambda _, cid=cid, sock=sock: self._gone(cid, sock))

    def _gone(self, cid: int, sock: socket.socket) -> None:
        self.authed.pop(cid, None)
        sock.close()  # its descriptor is freed even when its task was cancelled before it ran

    async def _serve_conn(self, cid: int, sock: socket.socket) -> None:
        """A connection past its hello: its frames until it closes, idles out or breaks the framing."""
        writer = out = None
        streams: dict[int, asyncio.Task] = {}
        lim = self.limits
        try:
            reader, writer = await asyncio.open_connection(sock=sock)
            keepalive(sock)
            out = StreamOut(writer, self.counters, lim.coalesce, lim.max_unsent_bytes, lim.drain_timeout_s)
            owner = f"socket-{self.incarnation[:8]}-{cid}"  # this connection's requests (actors/inflight.py)
            while True:
                try:
                    frame = await read_frame_within(reader, self.max_frame_bytes, lim.idle_timeout_s,
                                                    lim.frame_timeout_s)
                except FrameIdle:
                    if streams:
                        continue
                    self.counters["socket_idle_closed"] += 1
                    self.refusals.note(f"idle for {lim.idle_timeout_s:g}s with no stream")
                    return
                if frame is None:
                    return
                self._frame(frame, streams, out, owner)
        except FrameError as e:
            self.counters["socket_bad_frames"] += 1
            if "deadline" in str(e):
                self.counters["socket_frame_timeouts"] += 1
            self.refusals.note(f"closed: {e}"[:120])
        except (asyncio.IncompleteReadError, OSError) as e:  # a reset, a cut frame, a TCP keepalive timeout
            self.refusals.note(f"closed: {type(e).__name__}")
        finally:
            if streams:  # the connection is gone, and with it whoever would read these streams
                self.counters["socket_dropped"] += len(streams)
                log.warning("shard %s: a stream connection closed with %d streams open: aborting them", self.name,
                            len(streams))
            for task in list(streams.values()):
                task.cancel()
            await asyncio.gather(*streams.values(), return_exceptions=True)
            self._close(writer, out, sock)

    @staticmethod
    def _close(writer: asyncio.StreamWriter | None, out: StreamOut | None, sock: socket.socket) -> None:
        """Free the connection's descriptor now: a clean close when nothing is left to send, else an abort (a peer
        that does not read must not keep it)."""
        if out is not None:
            out.flush()
        if writer is None:
            sock.close()
        elif writer.transport.get_write_buffer_size() == 0:
            writer.close()
        else:
            writer.transport.abort()

    def _frame(self, frame: list, streams: dict[int, asyncio.Task], out: StreamOut, owner: str) -> None:
        """One frame after the hello. A malformed OPEN or CANCEL is refused alone; other kinds from a client close
        the connection (FrameError)."""
        kind = frame[0]
        if kind == Frame.PING and len(frame) == 1:
            return
        if kind in (Frame.OPEN, Frame.BATCH) and len(frame) == 5:
            sid, payload, caller, client = frame[1:]
            if type(sid) is not int or sid in streams:
                return self._bad(f"OPEN with an unusable stream id {str(sid)[:40]}")
            if not isinstance(payload, bytes):
                self._bad("OPEN whose payload is not bytes")
                out.send(encode_frame(Frame.FAIL, sid, "the OPEN frame's payload must be bytes"))
                return
            caller, client = (x if isinstance(x, str) else None for x in (caller, client))
            self.counters["socket_batches" if kind == Frame.BATCH else "socket_streams"] += 1
            task = asyncio.get_running_loop().create_task(self._stream(out, sid, payload, caller, client, owner,
                                                                       kind == Frame.BATCH))
            streams[sid] = task
            task.add_done_callback(lambda _, sid=sid: streams.pop(sid, None))
            return
        if kind == Frame.CANCEL and len(frame) == 2:
            sid = frame[1]
            if type(sid) is not int:
                return self._bad(f"CANCEL with an unusable stream id {str(sid)[:40]}")
            task = streams.pop(sid, None)
            if task is not None:
                self.counters["socket_cancels"] += 1
                task.cancel()
            return
        if kind == Frame.ABORT and len(frame) == 2:
            ids = frame[1]
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids) or self.abort is None:
                return self._bad("ABORT without a list of request ids")
            self.abort(ids, owner)
            return
        if kind in (Frame.OPEN, Frame.BATCH, Frame.CANCEL, Frame.PING, Frame.ABORT):
            return self._bad(f"{Frame(kind).name} frame of {len(frame)} elements")
        raise FrameError(f"unexpected frame {str(frame)[:80]}")

    def _bad(self, what: str) -> None:
        self.counters["socket_bad_frames"] += 1
        self.refusals.note(f"frame refused: {what}")

    async def _stream(self, out: StreamOut, sid: int, payload: bytes, caller: str | None, client: str | None,
                      owner: str, batch: bool = False) -> None:
        items = self.items(payload, caller, client, owner, batch=True) if batch else \
            self.items(payload, caller, client, owner)
        try:
            async with aclosing(items):  # closed when cancelled
                async for item in items:
                    kind = Frame.CHUNK if isinstance(item, list) else Frame.RESULT
                    out.send(encode_frame(kind, sid, item))
                    await out.room()
        except CutOff as e:  # the peer does not read: the connection is aborted, its reader ends it and its streams
            self.refusals.note(f"cut off: {e}"[:120])
        except ConnectionError:  # the connection went: _serve_conn aborts what is left of its streams
            return
        except Exception as e:  # a bug: the client must not wait forever (the Ray path raises it to the caller)
            log.exception("shard %s: stream %d failed", self.name, sid)
            out.send(encode_frame(Frame.FAIL, sid, f"{type(e).__name__}: {e}"))
