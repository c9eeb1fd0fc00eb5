"""The socket stream transport's two ends without Ray (issue 18 item 2): an actors.stream_server.StreamServer over
a stand-in item generator and the client's StreamConn, over real TCP on localhost. The error paths: a stream the
shard fails, frames that break the framing, a connection that breaks under open streams (each raises what the Ray
transport raises when its shard dies), a stream cancelled or left by its connection (its generator closed)."""
import asyncio

import pytest
from ray.exceptions import RayActorError

from actors.stream_server import StreamServer
from flame_llm.protocol.stream_frames import Frame, FrameError, encode_frame, read_frame
from flame_llm.serving.stream_conn import StreamConn, StreamFailed


class Items:
    """A stand-in for EngineActor.stream_items: payload b"N" yields N chunks of one token, then b"result";
    b"fail" raises after one chunk; b"hang" yields one chunk and waits. `closed` counts generators that ended
    without their result (the engine request aborted)."""

    def __init__(self) -> None:
        self.closed = 0
        self.seen: list[tuple] = []

    async def __call__(self, payload: bytes, caller, client, owner=None, batch=False):
        self.seen.append((payload, caller, client))
        done = False
        try:
            if batch:  # a batch of int(payload) requests: one result payload per request, no chunks
                for i in range(int(payload)):
                    yield b"results-%d" % i
                done = True
                return
            if payload == b"fail":
                yield [1]
                raise ValueError("a bug in the shard")
            if payload == b"hang":
                yield [1]
                await asyncio.sleep(3600)
            for i in range(int(payload)):
                yield [i]
            done = True
            yield b"result"
        finally:
            if not done:
                self.closed += 1


async def _server(items: Items, max_payload_bytes: int = 1 << 16, abort=None):
    server = StreamServer(items, max_payload_bytes, "test", "inc-1", abort=abort)
    return server, await server.start("127.0.0.1")


async def _conn(ep, token=None):
    reader, writer = await asyncio.open_connection(ep.host, ep.port)
    writer.write(encode_frame(Frame.HELLO, ep.token if token is None else token))
    return StreamConn(0, ep, reader, writer)


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """What the peer sent before it closed the connection (a close with our frames unread resets it)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout=30)
    except ConnectionResetError:
        return b""


async def _drain(q: asyncio.Queue) -> list:
    out = []
    while True:
        item = await asyncio.wait_for(q.get(), timeout=10)
        if isinstance(item, BaseException):
            raise item
        out.append(item)
        if isinstance(item, bytes):
            return out


async def _until(cond, timeout_s=10.0):
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_streams_multiplex_over_one_connection_and_a_failed_one_raises():
    async def main():
        items = Items()
        server, ep = await _server(items)
        conn = await _conn(ep)
        (a, qa), (b, qb), (f, qf) = (conn.open(p, "job", "cl") for p in (b"3", b"5", b"fail"))
        assert (a, b, f) == (0, 1, 2)
        got_a, got_b = await asyncio.gather(_drain(qa), _drain(qb))
        assert got_a == [[0], [1], [2], b"result"] and got_b == [[0], [1], [2], [3], [4], b"result"]
        assert await asyncio.wait_for(qf.get(), 10) == [1]
        with pytest.raises(StreamFailed, match="ValueError: a bug in the shard"):
            await _drain(qf)
        conn.done(a)
        conn.done(b)  # a stream's reader says when it is done (a batch has several RESULT frames)
        assert items.seen[0] == (b"3", "job", "cl") and conn.broken is None and not conn.streams
        assert server.counters["socket_streams"] == 3 and server.counters["socket_connections"] == 1
        conn.close("done")
        await server.stop()

    asyncio.run(main())


def test_a_batch_answers_in_several_result_frames_and_abort_frames_reach_the_shard():
    """A BATCH frame: its results come back as RESULT frames, one per group finished, on one stream id (its reader
    counts them); an ABORT frame names request ids of the connection's batches, aborted as the connection's own."""
    async def main():
        items, aborted = Items(), []
        server, ep = await _server(items, abort=lambda ids, owner: aborted.append((ids, owner)))
        conn = await _conn(ep)
        sid, q = conn.open(b"3", "job", "cl", Frame.BATCH)
        got = [await asyncio.wait_for(q.get(), 10) for _ in range(3)]
        assert got == [b"results-0", b"results-1", b"results-2"] and sid in conn.streams
        conn.done(sid)
        conn.abort(["r1", "r2"])
        await _until(lambda: aborted)
        assert aborted[0][0] == ["r1", "r2"] and aborted[0][1].startswith("socket-")
        assert server.counters["socket_batches"] == 1 and server.counters["socket_streams"] == 0
        conn.close("done")
        await server.stop()

    asyncio.run(main())


def test_a_cancelled_stream_and_a_dropped_connection_close_their_generators():
    async def main():
        items = Items()
        server, ep = await _server(items)
        conn = await _conn(ep)
        sid, q = conn.open(b"hang", None, None)
        assert await asyncio.wait_for(q.get(), 10) == [1]
        conn.cancel(sid)
        await _until(lambda: items.closed == 1)
        assert server.counters["socket_cancels"] == 1
        _, q2 = conn.open(b"hang", None, None)
        _, q3 = conn.open(b"hang", None, None)
        await asyncio.wait_for(q2.get(), 10), await asyncio.wait_for(q3.get(), 10)
        conn.close("the test leaves")
        await _until(lambda: items.closed == 3)
        assert server.counters["socket_dropped"] == 2
        await server.stop()

    asyncio.run(main())


def test_a_connection_broken_under_open_streams_raises_a_lost_shard_for_each():
    async def main():
        items = Items()
        server, ep = await _server(items)
        conn = await _conn(ep)
        qs = [conn.open(b"hang", None, None)[1] for _ in range(2)]
        for q in qs:
            assert await asyncio.wait_for(q.get(), 10) == [1]
        await server.stop()  # the shard's side goes, as when its process dies
        for q in qs:
            with pytest.raises(RayActorError, match="stream connection to shard 0 .* broke"):
                await _drain(q)
        with pytest.raises(RayActorError):  # nothing more is sent on a broken connection
            conn.open(b"1", None, None)

    asyncio.run(main())


def test_frames_that_break_the_framing_close_the_connection():
    async def main():
        items = Items()
        server, ep = await _server(items, max_payload_bytes=1024)
        bad = [encode_frame(Frame.OPEN, 0, b"x" * 4096, None, None),  # over the frame limit
               b"\x00\x00\x00\x02\xc1\xc1",  # not msgpack
               encode_frame(Frame.CHUNK, 0, [1])]  # a shard's frame from a client
        for frame in bad:
            reader, writer = await asyncio.open_connection(ep.host, ep.port)
            writer.write(encode_frame(Frame.HELLO, ep.token) + frame)
            assert await _closed(reader) == b""  # closed, nothing served
            writer.close()
        assert items.seen == [] and server.counters["socket_connections"] == 3
        reader, writer = await asyncio.open_connection(ep.host, ep.port)
        writer.write(b"\x00\x10\x00\x00")  # a 1 MiB hello
        assert await _closed(reader) == b""
        assert server.counters["socket_refused"] == 1
        await server.stop()
        r = asyncio.StreamReader()
        r.feed_data(encode_frame(99, 1))
        with pytest.raises(FrameError, match="not a frame"):
            await read_frame(r, 100)

    asyncio.run(main())
