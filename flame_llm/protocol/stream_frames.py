"""The socket stream transport's framing (ClientConfig.stream_transport = "socket"): how a client and an engine
actor's stream server (actors/stream_server.py, flame_llm/serving/stream_conn.py) carry many streams over one
TCP connection. Only the framing is here: a stream's request payload and its result payload are the bytes of the
one wire codec (flame_llm/protocol/wire.py), exactly what the Ray `stream` method takes and yields.

A frame is a 4-byte big-endian length, then a msgpack array whose first element is its kind:

    client -> shard   [HELLO, token]                         first frame of a connection, else it is closed
                      [OPEN, stream id, payload, caller, client]
                      [CANCEL, stream id]                    the caller left: the stream is aborted on the shard
    shard -> client   [CHUNK, stream id, [token ids]]        as the engine samples them
                      [RESULT, stream id, result payload]    the stream's last frame
                      [FAIL, stream id, message]             the shard could not serve it (a bug): its last frame

A connection that closes ends every stream on it: the shard aborts them, the client's raise as a lost shard."""
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
FRAME_OVERHEAD = 1024  # a frame's bytes besides its payload (kind, ids, caller, client, msgpack headers)
_LEN = struct.Struct(">I")
# a peer whose node is gone (no FIN, no RST) is noticed by TCP keepalive: idle, interval (s), probes
KEEPALIVE = (10, 5, 3)


class Frame(IntEnum):
    HELLO = 0
    OPEN = 1
    CANCEL = 2
    CHUNK = 3
    RESULT = 4
    FAIL = 5


class FrameError(ValueError):
    """A frame that breaks the framing (too long, not a msgpack array of a known kind): the connection closes."""


@dataclass(slots=True, frozen=True)
class StreamEndpoint:
    """Where an engine actor's stream server listens, and the secret a connection presents first (one per actor
    incarnation: a restarted actor has a new server, port and token)."""
    host: str
    port: int
    token: str = field(repr=False)
    incarnation: str = ""

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
    (n,) = _LEN.unpack(head)
    if n > max_bytes:
        raise FrameError(f"frame of {n} bytes is over the limit of {max_bytes}")
    body = await reader.readexactly(n)
    try:
        parts = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for bad input
        raise FrameError(f"unreadable frame: {type(e).__name__}: {e}") from None
    if not isinstance(parts, list) or not parts or parts[0] not in Frame._value2member_map_:
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
