"""Issue 37: the stream port's bounds (actors/stream_guard.py) on a real StreamServer over real TCP on 127.0.0.1,
with the stand-in item generator of test_stream_socket_frames: the hello deadline, the pending and authenticated
caps, idle and slow-frame timeouts, bad frames refused (closing only what they must), a socket error (TCP
keepalive) handled, descriptors freed, and refusals logged as bounded summaries."""
import asyncio
import errno
import logging
import os

from test_stream_socket_frames import Items, _closed, _drain, _until

from actors import stream_server
from actors.shard_options import ShardOptions
from actors.stream_server import StreamServer
from flame_llm.protocol.stream_frames import Frame, encode_frame
from flame_llm.serving.stream_conn import StreamConn


def _limits(**kw):
    base = {"stream_hello_timeout_s": 0.4, "stream_max_pending": 64, "stream_max_connections": 64,
            "stream_idle_timeout_s": 30.0, "stream_frame_timeout_s": 5.0}
    return ShardOptions(**{**base, **kw}).stream_limits()


async def _server(items=None, **kw):
    server = StreamServer(items or Items(), 1 << 16, "test", "inc-1", _limits(**kw))
    return server, await server.start("127.0.0.1")


async def _authed(ep):
    reader, writer = await asyncio.open_connection(ep.host, ep.port)
    writer.write(encode_frame(Frame.HELLO, ep.token))
    return reader, writer


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_silent_connection_is_closed_at_the_hello_deadline_and_its_descriptor_freed():
    async def main():
        server, ep = await _server()
        base = _fds()
        conns = [await asyncio.open_connection(ep.host, ep.port) for _ in range(20)]
        t0 = asyncio.get_running_loop().time()
        for reader, _ in conns:
            assert await _closed(reader) == b""
        assert asyncio.get_running_loop().time() - t0 < 2.0
        assert server.counters["socket_hello_timeouts"] == 20 and server.counters["socket_refused"] == 20
        for _, writer in conns:
            writer.close()
        await _until(lambda: _fds() <= base and not server.pending)
        await server.stop()

    asyncio.run(main())


def test_bad_frames_before_the_hello_are_refused_not_raised():
    async def main():
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
        server, ep = await _server()
        for body in ([[1]], [{}], [True, ep.token], []):
            reader, writer = await asyncio.open_connection(ep.host, ep.port)
            writer.write(encode_frame(*body))
            assert await _closed(reader) == b""
            writer.close()
        await _until(lambda: server.counters["socket_refused"] == 4)
        assert server.counters["socket_hello_timeouts"] == 0 and not errors
        await server.stop()

    asyncio.run(main())


def test_past_the_pending_cap_the_oldest_silent_connection_goes_and_a_valid_client_still_gets_in():
    async def main():
        items = Items()
        # TCP_DEFER_ACCEPT off: with it, silent connections stay in the kernel (15 s here), never pending
        server, ep = await _server(items, stream_hello_timeout_s=30.0, stream_max_pending=4, stream_defer_accept=False)
        silent = [await asyncio.open_connection(ep.host, ep.port) for _ in range(10)]
        await _until(lambda: server.counters["socket_refused_cap"] == 6)
        assert len(server.pending) <= 4
        for reader, _ in silent[:6]:  # the oldest six were closed
            assert await _closed(reader) == b""
        conn = StreamConn(0, ep, *await _authed(ep))
        _, q = conn.open(b"2", None, None)
        assert await _drain(q) == [[0], [1], b"result"]
        conn.close("done")
        for _, writer in silent:
            writer.close()
        await server.stop()

    asyncio.run(main())


def test_past_the_connection_cap_a_new_authenticated_connection_is_closed():
    async def main():
        server, ep = await _server(stream_max_connections=2)
        kept = [await _authed(ep) for _ in range(2)]
        await _until(lambda: server.counters["socket_connections"] == 2)
        reader, writer = await _authed(ep)
        assert await _closed(reader) == b""
        assert server.counters["socket_refused_cap"] == 1 and len(server.authed) == 2
        for _, w in [*kept, (reader, writer)]:
            w.close()
        await server.stop()

    asyncio.run(main())


def test_an_idle_connection_is_closed_but_a_pinging_client_and_one_with_a_stream_are_kept():
    async def main():
        items = Items()
        server, ep = await _server(items, stream_idle_timeout_s=0.3)
        assert ep.idle_timeout_s == 0.3
        mute_reader, mute_writer = await _authed(ep)  # never pings
        pinging = StreamConn(0, ep, *await _authed(ep))  # pings at a third of the idle timeout
        busy = StreamConn(1, ep, *await _authed(ep))
        busy.pinger.cancel()  # its stream alone must keep it
        _, q = busy.open(b"hang", None, None)
        assert await asyncio.wait_for(q.get(), 10) == [1]
        assert await _closed(mute_reader) == b""
        await asyncio.sleep(1.2)  # four idle timeouts
        assert pinging.broken is None and busy.broken is None
        assert server.counters["socket_idle_closed"] == 1
        _, q2 = pinging.open(b"1", None, None)
        assert await _drain(q2) == [[0], b"result"]
        for c in (pinging, busy):
            c.close("done")
        mute_writer.close()
        await server.stop()

    asyncio.run(main())


def test_a_byte_a_tick_sender_is_closed_at_the_frame_deadline():
    async def main():
        server, ep = await _server(stream_frame_timeout_s=0.5)
        reader, writer = await _authed(ep)
        frame = encode_frame(Frame.OPEN, 0, b"1", None, None)
        t0 = asyncio.get_running_loop().time()
        for i in range(len(frame)):
            writer.write(frame[i:i + 1])
            await asyncio.sleep(0.1)
            if server.counters["socket_frame_timeouts"]:
                break
        assert await _closed(reader) == b""
        assert server.counters["socket_frame_timeouts"] == 1 and asyncio.get_running_loop().time() - t0 < 2.0
        writer.close()
        await server.stop()

    asyncio.run(main())


def test_a_malformed_cancel_or_open_is_refused_alone_and_the_other_streams_go_on():
    async def main():
        items = Items()
        server, ep = await _server(items)
        conn = StreamConn(0, ep, *await _authed(ep))
        sid, q = conn.open(b"hang", None, None)
        assert await asyncio.wait_for(q.get(), 10) == [1]
        conn.writer.write(encode_frame(Frame.CANCEL, [sid]) + encode_frame(Frame.OPEN, [7], b"1", None, None)
                          + encode_frame(Frame.CANCEL))
        _, q2 = conn.open(b"3", None, None)
        assert await _drain(q2) == [[0], [1], [2], b"result"]
        assert server.counters["socket_bad_frames"] == 3 and items.closed == 0 and conn.broken is None
        conn.cancel(sid)
        await _until(lambda: items.closed == 1)
        conn.close("done")
        await server.stop()

    asyncio.run(main())


def test_a_socket_error_under_a_connection_ends_it_quietly(monkeypatch):
    """A TCP keepalive timeout surfaces as OSError(ETIMEDOUT) from the read; here the read raises it (a fake for
    a dead peer's keepalive probes, which take minutes): the connection ends, its streams are aborted, and nothing
    escapes the handler."""
    async def main():
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
        items = Items()
        server, ep = await _server(items)
        conn = StreamConn(0, ep, *await _authed(ep))
        _, q = conn.open(b"hang", None, None)
        assert await asyncio.wait_for(q.get(), 10) == [1]
        real = stream_server.read_frame_within

        async def timed_out(*args):
            raise OSError(errno.ETIMEDOUT, "Connection timed out")

        monkeypatch.setattr(stream_server, "read_frame_within", timed_out)
        conn.writer.write(encode_frame(Frame.PING))  # wakes the server's read; the next one raises
        await _until(lambda: items.closed == 1 and not server.authed)
        monkeypatch.setattr(stream_server, "read_frame_within", real)
        assert server.counters["socket_dropped"] == 1 and not errors
        conn.close("done")
        await server.stop()

    asyncio.run(main())


def test_refusals_are_logged_as_bounded_summaries(caplog):
    async def main():
        server, ep = await _server()
        for _ in range(100):
            reader, writer = await asyncio.open_connection(ep.host, ep.port)
            writer.write(encode_frame(Frame.HELLO, "wrong"))
            assert await _closed(reader) == b""
            writer.close()
        await _until(lambda: server.counters["socket_refused"] == 100)
        server.refusals.flush()
        await server.stop()
        return server

    with caplog.at_level(logging.WARNING, logger="actors.stream_server"):
        server = asyncio.run(main())
    lines = [r for r in caplog.records if "refused or closed" in r.getMessage()]
    assert 1 <= len(lines) <= 3 and server.refusals.lines == len(lines)
    assert sum(int(r.getMessage().split(": ")[1].split(" ")[0]) for r in lines) == 100


def test_a_bad_stream_bound_is_refused_naming_the_field():
    import pytest
    with pytest.raises(ValueError, match="shard field 'stream_hello_timeout_s'"):
        ShardOptions(stream_hello_timeout_s=0)
    with pytest.raises(ValueError, match="shard field 'stream_max_pending'"):
        ShardOptions(stream_max_pending=0)
    with pytest.raises(ValueError, match="shard field 'stream_max_connections'"):
        ShardOptions(stream_max_connections="many")
