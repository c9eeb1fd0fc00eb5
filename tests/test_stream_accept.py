"""Issue 37: the stream server's connections before their hello as bare sockets (actors/stream_accept.py), on a real
StreamServer over real TCP on 127.0.0.1: no asyncio task per pending connection, at most ACCEPT_BATCH accepted a
loop turn (accept_share 1.0), a timer at the deadline closing those past it (a silent one and one that stalls
mid-hello), and a valid hello read exactly (split over writes, or followed by frames in the same write: nothing
after it lost)."""
import asyncio
import socket

from test_stream_guard import _server
from test_stream_socket_frames import _closed, _until

from actors import stream_accept
from flame_llm.protocol.stream_frames import Frame, encode_frame, read_frame


def test_pending_connections_hold_no_task_and_are_swept_at_the_deadline():
    async def main():
        server, ep = await _server(stream_hello_timeout_s=0.3)
        tasks0 = len(asyncio.all_tasks())
        conns = [await asyncio.open_connection(ep.host, ep.port) for _ in range(40)]
        await _until(lambda: len(server.pending) == 40)
        assert len(asyncio.all_tasks()) - tasks0 <= 2  # before: a task (and a StreamReader/Writer) per connection
        stalled_reader, stalled = await asyncio.open_connection(ep.host, ep.port)
        stalled.write(encode_frame(Frame.HELLO, ep.token)[:5])  # half a hello, then nothing
        t0 = asyncio.get_running_loop().time()
        for reader, _ in [*conns, (stalled_reader, None)]:
            assert await _closed(reader) == b""
        took = asyncio.get_running_loop().time() - t0
        assert took < 0.3 + 0.25  # a timer at the deadline (before: a periodic sweep, up to 1 s late)
        assert server.counters["socket_hello_timeouts"] == 41 and server.counters["socket_refused"] == 41
        assert not server.pending
        for _, writer in conns:
            writer.close()
        stalled.close()
        await server.stop()

    asyncio.run(main())


def test_at_most_a_batch_is_accepted_in_one_loop_turn():
    async def main():
        # accept_share 1.0 and no TCP_DEFER_ACCEPT: accepting as before the flood pacing (test_stream_accept_pace)
        server, ep = await _server(stream_hello_timeout_s=30.0, stream_max_pending=512, stream_accept_share=1.0,
                                   stream_defer_accept=False)
        n = stream_accept.ACCEPT_BATCH * 2 + 10
        socks = []
        for _ in range(n):  # connected in the kernel's backlog while the loop does not run
            s = socket.socket()
            s.connect((ep.host, ep.port))
            socks.append(s)
        calls = []
        acceptor = server.acceptor
        orig = acceptor._accept

        def counted(lsock):
            before = len(acceptor.pending)
            orig(lsock)
            calls.append(len(acceptor.pending) - before)

        lsock = acceptor.listeners[0]
        loop = asyncio.get_running_loop()
        loop.remove_reader(lsock.fileno())
        loop.add_reader(lsock.fileno(), counted, lsock)
        await _until(lambda: len(acceptor.pending) == n)
        assert max(calls) == stream_accept.ACCEPT_BATCH and sum(calls) == n
        assert server.counters["socket_accept_pauses"] == 0
        for s in socks:
            s.close()
        await server.stop()

    asyncio.run(main())


def test_a_hello_is_read_exactly_split_or_followed_by_frames():
    async def main():
        server, ep = await _server()
        hello = encode_frame(Frame.HELLO, ep.token)
        # the hello in three writes, then an OPEN; and a hello with two OPENs behind it in one write
        reader, writer = await asyncio.open_connection(ep.host, ep.port)
        for part in (hello[:2], hello[2:7], hello[7:]):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(encode_frame(Frame.OPEN, 0, b"2", None, None))
        reader2, writer2 = await asyncio.open_connection(ep.host, ep.port)
        writer2.write(hello + encode_frame(Frame.OPEN, 0, b"1", None, None) + encode_frame(Frame.OPEN, 1, b"2",
                                                                                          None, None))
        got = [await asyncio.wait_for(read_frame(reader, 1 << 16), 10) for _ in range(3)]
        assert got == [[Frame.CHUNK, 0, [0]], [Frame.CHUNK, 0, [1]], [Frame.RESULT, 0, b"result"]]
        got2 = [await asyncio.wait_for(read_frame(reader2, 1 << 16), 10) for _ in range(5)]
        assert [f for f in got2 if f[1] == 1] == [[Frame.CHUNK, 1, [0]], [Frame.CHUNK, 1, [1]],
                                                   [Frame.RESULT, 1, b"result"]]
        assert server.counters["socket_connections"] == 2 and server.counters["socket_refused"] == 0
        assert not server.pending and len(server.authed) == 2
        writer.close()
        writer2.close()
        await _until(lambda: not server.authed)
        await server.stop()

    asyncio.run(main())


def test_a_wrong_token_and_an_oversized_hello_are_refused_without_an_answer():
    async def main():
        server, ep = await _server()
        for data in (encode_frame(Frame.HELLO, "0" * 32), b"\x00\x00\x10\x00" + b"x" * 64):
            reader, writer = await asyncio.open_connection(ep.host, ep.port)
            writer.write(data)
            assert await _closed(reader) == b""
            writer.close()
        assert server.counters["socket_refused"] == 2 and server.counters["socket_hello_timeouts"] == 0
        assert not server.pending and not server.authed
        await server.stop()

    asyncio.run(main())


