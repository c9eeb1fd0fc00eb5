"""Issues 37 and 39: a stream connection's output (actors/stream_out.py) on a real StreamServer over real TCP on
127.0.0.1. The frames one engine step gives a connection's streams leave as one write, and the client reads them
as before; with coalescing off every frame is its own write and the bytes are the same; a peer that does not read
is cut off once its unsent bytes stay over the bound for the drain deadline (its streams' generators closed: the
engine requests aborted), while another connection goes on."""
import asyncio
import socket

import pytest
from test_stream_socket_frames import Items, _drain, _until

from actors.shard_options import ShardOptions
from actors.stream_server import StreamServer
from flame_llm.protocol.stream_frames import Frame, encode_frame
from flame_llm.serving.stream_conn import StreamConn


class Stepper(Items):
    """Stand-in streams woken by one shared step, as the engine's tokens reach every stream of a step in one loop
    turn: payload b"N" yields N one-token chunks, one per step, then b"result". b"big" yields 4 KiB chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.step = asyncio.Event()

    async def __call__(self, payload: bytes, caller, client, owner=None):
        self.seen.append((payload, caller, client))
        done = False
        try:
            if payload == b"big":
                for _ in range(20_000):  # ~80 MB if nobody stops it
                    yield list(range(1 << 12))
            for i in range(int(payload)):
                await self.step.wait()
                yield [i]
            done = True
            yield b"result"
        finally:
            if not done:
                self.closed += 1

    async def drive(self, steps: int) -> None:
        for _ in range(steps):
            self.step.set()
            self.step.clear()
            await asyncio.sleep(0.002)


async def _server(items, **kw):
    opts = ShardOptions(**{"stream_hello_timeout_s": 5.0, **kw})
    server = StreamServer(items, 1 << 16, "test", "inc-1", opts.stream_limits())
    return server, await server.start("127.0.0.1")


async def _conn(ep):
    reader, writer = await asyncio.open_connection(ep.host, ep.port)
    writer.write(encode_frame(Frame.HELLO, ep.token))
    return StreamConn(0, ep, reader, writer)


def test_one_steps_frames_for_a_connection_leave_as_one_write_and_read_as_before():
    async def main():
        items = Stepper()
        server, ep = await _server(items)
        conn = await _conn(ep)
        qs = [conn.open(b"20", None, None)[1] for _ in range(8)]
        await _until(lambda: len(items.seen) == 8)
        driver = asyncio.ensure_future(items.drive(25))
        got = await asyncio.gather(*(_drain(q) for q in qs))
        await driver
        assert all(g == [[i] for i in range(20)] + [b"result"] for g in got)
        c = server.counters
        assert c["socket_out_frames"] == 8 * 21
        # one write a step (the results go with the last step's tokens), not one a frame as before
        assert c["socket_out_writes"] <= 22, c
        assert c["socket_out_bytes"] > 0 and c["socket_cutoffs"] == 0
        conn.close("done")
        await server.stop()

    asyncio.run(main())


async def _raw_bytes(coalesce: bool) -> tuple[bytes, dict]:
    """What a raw client reads for three stand-in streams opened at once (until the third's result)."""
    items = Items()
    server, ep = await _server(items, stream_coalesce=coalesce)
    reader, writer = await asyncio.open_connection(ep.host, ep.port)
    writer.write(encode_frame(Frame.HELLO, ep.token)
                 + b"".join(encode_frame(Frame.OPEN, sid, str(n).encode(), None, None)
                            for sid, n in enumerate((3, 1, 4))))
    want = b"".join(encode_frame(Frame.CHUNK, sid, [i]) for sid, n in enumerate((3, 1, 4)) for i in range(n))
    got = b""
    while len(got) < len(want) + 3 * len(encode_frame(Frame.RESULT, 0, b"result")):
        got += await asyncio.wait_for(reader.read(1 << 16), 10)
    writer.close()
    await server.stop()
    return got, dict(server.counters)


def test_coalescing_off_writes_each_frame_alone_and_the_bytes_are_the_same_either_way():
    async def main():
        off, c_off = await _raw_bytes(False)
        on, c_on = await _raw_bytes(True)
        frames = 3 + 1 + 4 + 3
        # each stream's frames in turn (the stand-in yields without waiting), as before
        def expected(sid: int, n: int) -> bytes:
            return b"".join(encode_frame(Frame.CHUNK, sid, [i]) for i in range(n)) \
                + encode_frame(Frame.RESULT, sid, b"result")

        assert off == on == b"".join(expected(sid, n) for sid, n in enumerate((3, 1, 4)))
        assert c_off["socket_out_frames"] == c_off["socket_out_writes"] == frames
        assert c_on["socket_out_frames"] == frames and c_on["socket_out_writes"] < frames
        assert c_off["socket_out_bytes"] == c_on["socket_out_bytes"] == len(off)

    asyncio.run(main())


def test_a_peer_that_does_not_read_is_cut_off_and_only_its_streams_end():
    async def main():
        items = Stepper()
        server, ep = await _server(items, stream_max_unsent_bytes=1 << 16, stream_drain_timeout_s=0.5)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's side fills
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (ep.host, ep.port))
        mute_reader, mute_writer = await asyncio.open_connection(sock=sock)
        mute_writer.write(encode_frame(Frame.HELLO, ep.token) + encode_frame(Frame.OPEN, 0, b"big", None, None)
                          + encode_frame(Frame.OPEN, 1, b"1000", None, None))
        reading = await _conn(ep)
        _, q = reading.open(b"5", None, None)
        driver = asyncio.ensure_future(items.drive(3000))
        t0 = asyncio.get_running_loop().time()
        await _until(lambda: server.counters["socket_cutoffs"] == 1)
        assert asyncio.get_running_loop().time() - t0 < 5.0
        await _until(lambda: items.closed == 2)  # both of the mute peer's streams: their engine requests aborted
        assert await _drain(q) == [[i] for i in range(5)] + [b"result"]  # the other connection goes on
        assert reading.broken is None
        await _until(lambda: len(server.authed) == 1)
        driver.cancel()
        mute_writer.close()
        reading.close("done")
        await server.stop()

    asyncio.run(main())


def test_output_fields_are_checked():
    with pytest.raises(ValueError, match="shard field 'stream_max_unsent_bytes'"):
        ShardOptions(stream_max_unsent_bytes=100)
    with pytest.raises(ValueError, match="shard field 'stream_drain_timeout_s'"):
        ShardOptions(stream_drain_timeout_s=0)
    with pytest.raises(ValueError, match="shard field 'stream_coalesce'"):
        ShardOptions(stream_coalesce="yes")
