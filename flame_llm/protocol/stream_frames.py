"""The socket transport's framing: how a client and an engine actor's stream server (actors/stream_server.py,
flame_llm/serving/stream_conn.py) carry many streams and batches over one TCP connection, the engine actor's one
request entry point. Only the framing is here: a request payload and a result payload are the bytes of the one wire
codec (flame_llm/protocol/wire.py), exactly what EngineActor.stream_items takes and yields.

A frame is a 4-byte big-endian length, then a msgpack array whose first element is its kind:

    client -> shard   [HELLO, token]                         first frame of a connection, else it is closed
                      [OPEN, stream id, payload, caller, client]    one request, its tokens streamed
                      [BATCH, stream id, payload, caller, client]   a batch, its results as they finish
                      [ABORT, [request ids]]                 abort these requests of this connection's (batches)
                      [CANCEL, stream id]                    the caller left: the stream is aborted on the shard
                      [PING]                                 an idle connection's sign of life (see idle_timeout_s)
    shard -> client   [CHUNK, stream id, [token ids]]        as the engine samples them
                      [RESULT, stream id, result payload]    a stream's last frame; a batch's results, one
                                                             frame per group finished (the client counts them)
                      [FAIL, stream id, message]             the shard could not serve it (a bug): its last frame

A connection that closes ends every stream on it: the shard aborts them, the client's raise as a lost shard.
The shard bounds every wait (actors/stream_guard.py): the hello, a connection with no stream and no frame (a client
pings at a third of the endpoint's idle_timeout_s), and each frame once its first byte arrived."""
from __future__ import annotations

import asyncio
import hmac
import secrets
import socket
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack

HELLO_MAX_BYTES = 256  # a frame before the token was presented is at most this long
FRAME_MIN_BYTES_PER_S = 1 << 20  # a frame's deadline grows by its length at this rate (beyond the frame timeout)
FRAME_OVERHEAD = 1024  # a frame's bytes besides its payload (kind, ids, caller, client, msgpack headers)
_LEN = struct.Struct(">I")
LEN_BYTES = _LEN.size  # a frame's length prefix
# a peer whose node is gone (no FIN, no RST) is noticed by TCP keepalive: idle, interval (s), probes
KEEPALIVE = (10, 5, 3)


class Frame(IntEnum):
    HELLO = 0
    OPEN = 1
    CANCEL = 2
    CHUNK = 3
    RESULT = 4
    FAIL = 5
    PING = 6
    BATCH = 7
    ABORT = 8


class FrameError(ValueError):
    """A frame that breaks the framing (too long, not a msgpack array of a known kind): the connection closes."""


class FrameIdle(FrameError):
    """No frame began within the wait (read_frame_within): the caller decides whether the connection is idle."""


class FrameTimeout(FrameError):
    """A frame began but did not complete within its deadline (a slow or stalled sender)."""


@dataclass(slots=True, frozen=True)
class StreamEndpoint:
    """Where an engine actor's stream server listens, and the secret a connection presents first (one per actor
    incarnation: a restarted actor has a new server, port and token)."""
    host: str
    port: int
    token: str = field(repr=False)
    incarnation: str = ""
    idle_timeout_s: float = 0.0  # the server closes a connection with no stream and no frame for this long (0: never)

    @staticmethod
    def new_token() -> str:
        return secrets.token_hex(16)

    def accepts(self, presented: Any) -> bool:
        return isinstance(presented, str) and hmac.compare_digest(presented.encode(), self.token.encode())


def encode_frame(*parts: Any) -> bytes:
    body = msgpack.packb(parts, use_bin_type=True)
    return _LEN.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> list | None:
    """The next frame's array, or None at a clean end of the stream (EOF between frames). FrameError for a frame
    over max_bytes or one that is not a msgpack array starting with a Frame kind; a connection cut mid-frame raises
    asyncio.IncompleteReadError."""
    try:
        head = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise
    n = _length(head, max_bytes)
    return _parse(await reader.readexactly(n))


async def read_frame_within(reader: asyncio.StreamReader, max_bytes: int, wait_s: float | None,
                            frame_s: float) -> list | None:
    """read_frame with deadlines: the frame's first byte within wait_s (None: no limit; FrameIdle past it, nothing
    read), the rest within frame_s plus its length at FRAME_MIN_BYTES_PER_S (FrameTimeout past it: a sender of a
    byte a second is cut there). A socket error (a keepalive timeout included) raises as an OSError."""
    try:
        async with asyncio.timeout(wait_s) as wait:
            first = await reader.readexactly(1)
    except asyncio.IncompleteReadError:
        return None
    except TimeoutError:
        if wait.expired():
            raise FrameIdle(f"no frame within {wait_s}s") from None
        raise  # the socket's own ETIMEDOUT (TCP keepalive): an OSError
    try:
        async with asyncio.timeout(frame_s) as deadline:
            n = _length(first + await reader.readexactly(_LEN.size - 1), max_bytes)
            deadline.reschedule(deadline.when() + n / FRAME_MIN_BYTES_PER_S)
            body = await reader.readexactly(n)
    except TimeoutError:
        if deadline.expired():
            raise FrameTimeout(f"a frame did not complete within its deadline ({frame_s}s + its length at "
                               f"{FRAME_MIN_BYTES_PER_S} B/s)") from None
        raise
    return _parse(body)


def frame_length(head: bytes, max_bytes: int) -> int:
    """A frame's body length from its 4-byte head (FrameError over max_bytes): for readers of bare sockets."""
    return _length(head, max_bytes)


def parse_frame(body: bytes) -> list:
    """A frame's array from its body (FrameError when it is not a frame): for readers of bare sockets."""
    return _parse(body)


def _length(head: bytes, max_bytes: int) -> int:
    (n,) = _LEN.unpack(head)
    if n > max_bytes:
        raise FrameError(f"frame of {n} bytes is over the limit of {max_bytes}")
    return n


def _parse(body: bytes) -> list:
    try:
        parts = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for bad input
        raise FrameError(f"unreadable frame: {type(e).__name__}: {e}") from None
    # type(...) is int: a list or a map there is unhashable, a bool is not a kind
    if not isinstance(parts, list) or not parts or type(parts[0]) is not int \
            or parts[0] not in Frame._value2member_map_:
        raise FrameError(f"not a frame: {str(parts)[:80]}")
    return parts


def keepalive(sock: socket.socket | None) -> None:
    """TCP keepalive on a stream connection's socket (both ends), where the platform has the options."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE, strict=True):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
