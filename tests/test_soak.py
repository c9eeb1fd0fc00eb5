"""bench/service/soak.py's verdict: flat within the tolerance between the window after warm-up and the last window; a
process that grew, or was replaced, is not flat; and /proc is read for a live process."""
import os

from bench.service.soak import FD_SLACK, Proc, read_proc, verdict


def _proc(rss_end: float, fds_end: int = 40, replaced: bool = False) -> Proc:
    p = Proc("x", 1, replaced=replaced)
    for t in range(0, 101, 5):  # linear from 100 MB / 40 fds to the end values
        f = t / 100
        p.samples.append((float(t), int(100e6 + f * (rss_end - 100e6)), round(40 + f * (fds_end - 40))))
    return p


def test_flat_and_not_flat():
    assert verdict(_proc(102e6), 100, 10, 0.05)["flat"]
    grown = verdict(_proc(130e6), 100, 10, 0.05)
    assert not grown["flat"] and not grown["rss_flat"] and grown["rss_growth"] > 0.05
    assert verdict(_proc(100e6, 40 + FD_SLACK), 100, 10, 0.05)["fds_flat"]  # a few sockets in flight
    assert not verdict(_proc(100e6, 80), 100, 10, 0.05)["fds_flat"]
    assert not verdict(_proc(100e6, replaced=True), 100, 10, 0.05)["flat"]


def test_read_proc_of_this_process():
    rss, fds = read_proc(os.getpid())
    assert rss > 1 << 20 and fds >= 3
    assert read_proc(2**22 + 12345) is None
