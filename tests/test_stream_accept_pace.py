"""Issue 37's flood, the accept path's side (actors/stream_accept.py, actors/stream_kernel.py), on a real StreamServer
over real TCP on 127.0.0.1: hello deadlines closed on time by one timer at the earliest; a connection's deadline
counted from its connect in the kernel (TCP_INFO) once accepting is paced, from its accept at accept_share 1.0 (as
before); under a flood, accepting in small rounds with pauses that keep it within its share of the loop's CPU time
(none at 1.0); TCP_DEFER_ACCEPT keeping silent connections in the kernel until the end of its period within the
hello deadline; the new shard fields checked."""
import asyncio
import socket
import sys
import time

import pytest
from test_stream_guard import _authed, _server
from test_stream_socket_frames import _until

from actors import stream_accept
from actors.shard_options import ShardOptions
from actors.stream_kernel import defer_period_s
from flame_llm.protocol.stream_frames import Frame, encode_frame, read_frame

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO and TCP_DEFER_ACCEPT are Linux's")


async def _close_times(socks: list[tuple[float, socket.socket]], timeout_s: float = 10.0) -> list[float]:
    """For each (connected at, socket): how long after its connect the server closed it."""
    loop = asyncio.get_running_loop()
    out = []
    for at, s in socks:
        s.setblocking(False)
        try:
            assert await asyncio.wait_for(loop.sock_recv(s, 1), timeout_s) == b""
        except ConnectionResetError:
            pass
        out.append(time.monotonic() - at)
        s.close()
    return out


def _connect(ep) -> tuple[float, socket.socket]:
    s = socket.create_connection((ep.host, ep.port))
    return time.monotonic(), s


def test_each_silent_connection_is_closed_at_its_own_deadline():
    async def main():
        server, ep = await _server(stream_hello_timeout_s=2.0, stream_defer_accept=False)
        socks = []
        for _ in range(8):  # staggered: a periodic sweep (before: every 0.5 s here) closes most of them late
            socks.append(_connect(ep))
            await asyncio.sleep(0.07)
        lives = await _close_times(socks)
        assert all(2.0 - 0.02 <= life <= 2.0 + 0.15 for life in lives), lives
        assert server.counters["socket_hello_timeouts"] == 8 and not server.pending
        await server.stop()

    asyncio.run(main())


def _backlogged(ep, n: int, wait_s: float) -> list[tuple[float, socket.socket]]:
    """n connections made while the loop is blocked for wait_s: they wait in the kernel's accept queue."""
    socks = [_connect(ep) for _ in range(n)]
    time.sleep(wait_s)
    return socks


@linux
def test_a_deadline_counts_from_the_connect_in_the_kernel_when_paced():
    async def main():
        server, ep = await _server(stream_hello_timeout_s=1.5, stream_defer_accept=False)  # paced (share 0.25)
        lives = await _close_times(_backlogged(ep, 3, 1.0))
        assert all(1.5 - 0.05 <= life <= 1.5 + 0.2 for life in lives), lives  # not 1.0 + 1.5
        assert server.counters["socket_hello_timeouts"] == 3
        # one that waited out its whole deadline in the queue is closed at its accept, never pending
        calls = []
        orig = server.acceptor._pend
        server.acceptor._pend = lambda sock: (calls.append(len(server.pending)), orig(sock))
        lives = await _close_times(_backlogged(ep, 2, 1.6))
        assert all(life < 1.6 + 0.15 for life in lives), lives
        assert server.counters["socket_hello_timeouts"] == 5 and len(calls) == 2 and not server.pending
        await server.stop()

    asyncio.run(main())


def test_at_share_1_a_deadline_counts_from_the_accept_as_before():
    async def main():
        server, ep = await _server(stream_hello_timeout_s=1.0, stream_accept_share=1.0, stream_defer_accept=False)
        lives = await _close_times(_backlogged(ep, 2, 0.6))
        assert all(1.6 - 0.05 <= life <= 1.6 + 0.2 for life in lives), lives
        await server.stop()

    asyncio.run(main())


async def _drain_backlog(share: float, n: int) -> tuple[list[int], float, float, object]:
    """n connections in the kernel's backlog, then accepted by a server at `share`: the size of each accept round,
    the CPU seconds the rounds took, the wall time from the first round to the last, the server."""
    server, ep = await _server(stream_hello_timeout_s=30.0, stream_max_pending=256, stream_accept_share=share,
                               stream_defer_accept=False)
    acceptor, loop = server.acceptor, asyncio.get_running_loop()
    rounds, cpu, first = [], [0.0], []
    orig = acceptor._accept

    def counted(lsock):
        accepted0, t0 = server.counters["socket_refused_cap"] + len(acceptor.pending), time.thread_time()
        first[:] = first or [time.monotonic()]
        orig(lsock)
        cpu[0] += time.thread_time() - t0
        rounds.append(server.counters["socket_refused_cap"] + len(acceptor.pending) - accepted0)

    acceptor._accept = counted  # what the listening socket's reader calls, again after each pause
    lsock = acceptor.listeners[0]
    loop.remove_reader(lsock.fileno())
    loop.add_reader(lsock.fileno(), counted, lsock)
    socks = _backlogged(ep, n, 0.0)
    await _until(lambda: sum(rounds) == n, 30)
    wall = time.monotonic() - first[0]
    for _, s in socks:
        s.close()
    await server.stop()
    return rounds, cpu[0], wall, server


def test_under_a_flood_accepting_is_paced_within_its_share_and_unpaced_at_1():
    async def main():
        n = 800  # within the listening backlog (1024); past the pending cap: the flood evicts itself
        rounds, cpu, wall, server = await _drain_backlog(0.25, n)
        assert max(rounds[1:]) == stream_accept.FLOOD_BATCH  # after a full first round: a flood
        assert server.counters["socket_accept_pauses"] >= len(rounds) - 2
        assert cpu / wall <= 0.25 * 1.3, (cpu, wall)  # the pauses: 3x the rounds' CPU time
        rounds1, cpu1, wall1, server1 = await _drain_backlog(1.0, n)
        assert max(rounds1) == stream_accept.ACCEPT_BATCH and server1.counters["socket_accept_pauses"] == 0
        assert len(rounds1) <= n // stream_accept.ACCEPT_BATCH + 2

    asyncio.run(main())


def test_under_a_flood_a_valid_client_gets_in_and_is_served():
    async def main():
        server, ep = await _server(stream_hello_timeout_s=30.0, stream_max_pending=64, stream_defer_accept=False)
        flood = _backlogged(ep, 500, 0.0)
        reader, writer = await _authed(ep)  # behind the flood in the backlog
        writer.write(encode_frame(Frame.OPEN, 0, b"1", None, None))
        got = [await asyncio.wait_for(read_frame(reader, 1 << 16), 20) for _ in range(2)]
        assert got == [[Frame.CHUNK, 0, [0]], [Frame.RESULT, 0, b"result"]]
        assert server.counters["socket_accept_pauses"] > 0 and server.counters["socket_connections"] == 1
        writer.close()
        for _, s in flood:
            s.close()
        await server.stop()

    asyncio.run(main())


def test_past_the_pending_cap_the_first_connected_go_first_though_the_kernel_rounds_their_ages(monkeypatch):
    """The kernel reports ages in jiffies (4 ms at HZ 250): two connections a fraction of a jiffy apart can look the
    other way round. The stub (the kernel's rounding, which this machine cannot be made to show on demand) makes
    every second accepted connection look 4 ms older than the one before it; the cap still closes in accept order
    (before: the rounding chose, and CI saw a newer connection closed in place of one of the oldest)."""
    ages = iter([0.004 * (i % 2) for i in range(100)])
    monkeypatch.setattr(stream_accept, "connection_age_s", lambda sock, deferred_s: next(ages))

    async def main():
        server, ep = await _server(stream_hello_timeout_s=30.0, stream_max_pending=4, stream_defer_accept=False)
        silent = [_connect(ep) for _ in range(10)]
        await _until(lambda: server.counters["socket_refused_cap"] == 6)
        assert sorted(p.deadline for p in server.pending.values()) == [p.deadline for p in server.pending.values()]
        lives = await _close_times(silent[:6], 5.0)  # the oldest six were closed
        assert all(life < 5.0 for life in lives), lives
        loop = asyncio.get_running_loop()
        for _, s in silent[6:]:  # the newest four wait for their hello
            s.setblocking(False)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(loop.sock_recv(s, 1), 0.2)
            s.close()
        await server.stop()

    asyncio.run(main())


@linux
def test_defer_accept_keeps_a_silent_connection_in_the_kernel_until_its_period_ends():
    async def main():
        server, ep = await _server(stream_hello_timeout_s=3.5)  # TCP_DEFER_ACCEPT on: the kernel's period is 3 s
        assert server.acceptor.deferred_s == 3
        silent = [_connect(ep) for _ in range(3)]
        late_reader, late = await asyncio.open_connection(ep.host, ep.port)
        reader, writer = await _authed(ep)
        writer.write(encode_frame(Frame.OPEN, 0, b"1", None, None))
        assert (await asyncio.wait_for(read_frame(reader, 1 << 16), 10))[0] == Frame.CHUNK
        await asyncio.sleep(0.5)
        late.write(encode_frame(Frame.HELLO, ep.token) + encode_frame(Frame.OPEN, 0, b"1", None, None))
        assert (await asyncio.wait_for(read_frame(late_reader, 1 << 16), 10))[0] == Frame.CHUNK  # sent late: in
        await asyncio.sleep(1.0)
        assert not server.pending and server.counters["socket_refused"] == 0  # the silent ones: not handed over
        lives = await _close_times(silent)  # handed over at 3 s, with the 0.5 s left of their deadline
        assert all(3.5 - 0.05 <= life <= 3.5 + 0.3 for life in lives), lives
        assert server.counters["socket_hello_timeouts"] == 3 and server.counters["socket_connections"] == 2
        for w in (writer, late):
            w.close()
        await server.stop()

    asyncio.run(main())


def test_the_defer_period_is_the_longest_within_the_hello_deadline():
    assert [defer_period_s(x) for x in (0.3, 1.0, 2.9, 3.0, 5.0, 7.0, 30.0, 200.0, 300.0)] == \
        [0, 1, 1, 3, 3, 7, 15, 127, 247]


def test_a_bad_accept_share_defer_or_reset_flag_is_refused_naming_the_field():
    for bad in (0, 1.5, -0.1, "half", True):
        with pytest.raises(ValueError, match="shard field 'stream_accept_share'"):
            ShardOptions(stream_accept_share=bad)
    with pytest.raises(ValueError, match="shard field 'stream_defer_accept'"):
        ShardOptions(stream_defer_accept=1)
    with pytest.raises(ValueError, match="shard field 'stream_refuse_reset'"):
        ShardOptions(stream_refuse_reset="yes")
    limits = ShardOptions(stream_accept_share=1.0, stream_defer_accept=False).stream_limits()
    assert limits.accept_share == 1.0 and limits.defer_accept is False and limits.refuse_reset is False
    assert ShardOptions(stream_refuse_reset=True).stream_limits().refuse_reset is True




def _time_wait_on(port: int) -> int:
    """Sockets in TIME_WAIT whose local port is `port` (/proc/net/tcp: state 06)."""
    with open("/proc/net/tcp") as f:
        rows = [ln.split() for ln in f.readlines()[1:]]
    return sum(1 for r in rows if int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "06")


@linux
@pytest.mark.parametrize("reset", [False, True])
def test_refuse_reset_resets_a_refused_connection_and_leaves_no_time_wait(reset):
    async def main():
        server, ep = await _server(stream_hello_timeout_s=0.5, stream_max_pending=3, stream_defer_accept=False,
                                   stream_refuse_reset=reset)
        socks = [_connect(ep) for _ in range(5)]  # 2 evicted by the pending cap, 3 past their deadline
        loop, got = asyncio.get_running_loop(), []
        for _, s in socks:
            s.setblocking(False)
            try:
                got.append(await asyncio.wait_for(loop.sock_recv(s, 1), 5))
            except ConnectionResetError:
                got.append("reset")
            s.close()  # the peer closes after the shard's FIN: the shard's side waits in TIME_WAIT (without reset)
        await asyncio.sleep(0.2)
        assert server.counters["socket_refused"] == 5 and server.counters["socket_refused_cap"] == 2
        assert got == (["reset"] * 5 if reset else [b""] * 5)
        assert _time_wait_on(ep.port) == (0 if reset else 5)
        await server.stop()

    asyncio.run(main())
