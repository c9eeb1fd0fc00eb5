"""What the kernel (Linux) knows of the stream port's connections before the loop accepts them (issue 37's flood):

- TCP_DEFER_ACCEPT on the listening socket: the kernel hands a connection over only once its first data (the
  client's hello) arrives, so silent connections wait in the kernel's SYN queue, not in the loop. It counts in whole
  SYN-ACK timer rounds (1 s, doubling up to 120 s: a connection that stays silent is handed over anyway after 1, 3,
  7, 15, 31, 63, 127, 247... s); `defer_period_s` is the longest of those not past the hello deadline, so such a
  connection arrives with the part of its deadline it has not spent.
- TCP_INFO of an accepted connection: how long it has been established (it waited in the accept queue, or was
  deferred), so that its hello deadline counts from its connect, not from its accept. Where TCP_INFO is missing
  (not Linux), a connection's age is 0: its deadline counts from its accept, as before."""
from __future__ import annotations

import logging
import socket
import struct

log = logging.getLogger(__name__)

SYNACK_TIMEOUT_S, SYNACK_TIMEOUT_MAX_S = 1, 120  # the kernel's TCP_TIMEOUT_INIT and TCP_RTO_MAX
# struct tcp_info (linux/tcp.h): the offsets of the fields read here, and the size that holds them (kernel >= 4.1)
_LAST_DATA_RECV, _TOTAL_RETRANS, _BYTES_RECEIVED, _INFO_BYTES = 52, 100, 128, 136
AGE_GRAIN_S = 0.010  # TCP_INFO's times are whole jiffies: 1/HZ, 10 ms at the smallest HZ (100), 4 ms at 250


def defer_period_s(hello_timeout_s: float) -> int:
    """The longest TCP_DEFER_ACCEPT period (whole SYN-ACK timer rounds) within hello_timeout_s; 0: none (< 1 s)."""
    best, period, timeout = 0, SYNACK_TIMEOUT_S, SYNACK_TIMEOUT_S
    while period <= hello_timeout_s:
        best = period
        timeout = min(2 * timeout, SYNACK_TIMEOUT_MAX_S)
        period += timeout
    return best


def defer_accept(lsock: socket.socket, hello_timeout_s: float) -> int:
    """Set TCP_DEFER_ACCEPT on a listening socket for the hello deadline; the period the kernel took (s), 0 where it
    cannot (not Linux, or a deadline under 1 s: connections are then handed over at their connect, as without)."""
    period = defer_period_s(hello_timeout_s)
    if period == 0 or not hasattr(socket, "TCP_DEFER_ACCEPT"):
        return 0
    try:
        lsock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, period)
        got = lsock.getsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT)
    except OSError as e:
        log.warning("TCP_DEFER_ACCEPT not set (%s): silent connections reach the loop at their connect", e)
        return 0
    assert got == period, (got, period)  # the kernel reports the period of the rounds it took
    return got


def connection_age_s(sock: socket.socket, deferred_s: int) -> float:
    """How long an accepted connection has been established in the kernel (a lower bound; 0 where unknown).
    deferred_s: the listening socket's TCP_DEFER_ACCEPT period (0: off) — a connection handed over with no byte
    received after its SYN-ACK was sent again was deferred to the end of that period (a connection past the SYN
    queue's room comes by a SYN cookie, undeferred, its SYN-ACK sent once)."""
    if not hasattr(socket, "TCP_INFO"):
        return 0.0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_BYTES)
    except OSError:
        return 0.0
    if len(info) < _INFO_BYTES:
        return 0.0
    # for a connection with nothing received yet, the time since its last data is the time since its handshake
    age = struct.unpack_from("I", info, _LAST_DATA_RECV)[0] / 1e3
    if deferred_s and struct.unpack_from("Q", info, _BYTES_RECEIVED)[0] == 0 \
            and struct.unpack_from("I", info, _TOTAL_RETRANS)[0] > 0:
        age += deferred_s
    return age
