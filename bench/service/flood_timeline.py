"""Where a flood's slow requests fall (bench/service/stream_flood.py, issue 37): a 0.1 s sampler of the CPU used by
the shard's process, the attacker's process and the whole machine, and for each of the slowest requests during the
flood: when it started (seconds after the attacker's start), what the attacker's connections did around it (opened,
closed by the shard) and who used the two cores while it ran. The attacker's process is the flood generator that
would run on another machine in a real attack; its CPU here is this machine's cost of simulating it, not the
shard's."""
from __future__ import annotations

import asyncio
import os
import time

BIN_S = 0.25  # the attacker's opens and closes are counted in bins of this width
SAMPLE_S = 0.1
BURST = 50  # a request during which the attacker opened or the shard closed this many connections: in a burst


def _cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _machine_s() -> tuple[float, float, float]:
    """(busy, total, irq + softirq) CPU seconds of the whole machine, all cores (from /proc/stat): the kernel's
    network work on loopback (both ends of every connection) is mostly softirq, counted in no process."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(v) - v[3] - v[4]) / tick, sum(v) / tick, (v[5] + v[6]) / tick


def pid_of(title: str) -> int | None:
    """The pid of the process whose command line starts with `title` (a Ray actor's: "ray::FrontDoor"), if one."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if f.read().startswith(title.encode()):
                        return int(d)
            except OSError:
                continue
    return None


class Sampler:
    """Every SAMPLE_S: CPU seconds of named processes (shard, attacker once its pid is set, door, this bench
    process), and of the machine."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = pids
        self.rows: list[tuple[float, dict[str, float], tuple[float, float, float]]] = []
        self.done = asyncio.Event()

    async def run(self) -> None:
        last: dict[str, float] = {}
        while not self.done.is_set():
            # a process gone (the attacker at its exit) keeps its last reading
            last = {k: max(_cpu_s(p), last.get(k, 0.0)) for k, p in self.pids.items()}
            self.rows.append((time.monotonic(), last, _machine_s()))
            await asyncio.sleep(SAMPLE_S)

    def window(self, t0: float, t1: float) -> dict:
        """Cores used in [t0, t1] (widened to the samples around it): each named process, the kernel's interrupt
        work, the rest (other processes: Ray's, other tenants'), idle."""
        before = [r for r in self.rows if r[0] <= t0] or self.rows[:1]
        after = [r for r in self.rows if r[0] >= t1] or self.rows[-1:]
        a, b = before[-1], after[0]
        dt = max(b[0] - a[0], 1e-3)
        out = {"window_s": round(dt, 3)}
        named = 0.0
        for k in self.pids:
            out[k] = round((b[1].get(k, 0) - a[1].get(k, 0)) / dt, 2)
            named += out[k]
        busy, cores, irq = ((y - x) / dt for x, y in zip(a[2], b[2]))
        out["irq"] = round(irq, 2)
        out["rest"] = round(max(0.0, busy - named - irq), 2)
        out["idle"] = round(max(0.0, cores - busy), 2)
        return out


def bins(times: list[float], t0: float) -> list[int]:
    """Counts of `times` in BIN_S bins from t0."""
    out: list[int] = []
    for t in times:
        i = max(0, int((t - t0) / BIN_S))
        out.extend([0] * (i + 1 - len(out)))
        out[i] += 1
    return out


def _around(counts: list[int], t: float, t1: float) -> int:
    lo, hi = max(0, int(t / BIN_S)), max(0, int(t1 / BIN_S))
    return sum(counts[lo:hi + 1])


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50_ms": round(1e3 * xs[len(xs) // 2], 1),
            "p99_ms": round(1e3 * xs[int(0.99 * (len(xs) - 1))], 1), "max_ms": round(1e3 * xs[-1], 1)}


def slowest(during: list[tuple[float, float]], flood: dict, sampler: Sampler, idle_p50_s: float, n: int = 8) -> dict:
    """The n slowest requests during the flood, each with its start after the attacker's start, the attacker's
    opens and the shard's closes in the bins it spans, and the cores used while it ran; and how many requests were
    over 2x the idle median."""
    t0 = flood["t0"]
    opens, closes = flood.get("opens", []), flood.get("closes", [])
    rows = []
    for start, lat in sorted(during, key=lambda x: -x[1])[:n]:
        s = start - t0
        rows.append({"at_s": round(s, 2), "ms": round(1e3 * lat, 1), "x_idle_p50": round(lat / idle_p50_s, 2),
                     "opens": _around(opens, s, s + lat), "closes": _around(closes, s, s + lat),
                     "cores": sampler.window(start, start + lat)})
    phases: dict[str, list[float]] = {"start": [], "burst": [], "quiet": []}
    for start, lat in during:
        s = start - t0
        kind = "start" if s < 2 * BIN_S else \
            "burst" if _around(opens, s, s + lat) + _around(closes, s, s + lat) >= BURST else "quiet"
        phases[kind].append(lat)
    over = [(round(s - t0, 2), round(1e3 * lat, 1)) for s, lat in during if lat > 2 * idle_p50_s]
    end = t0 + flood["duration_s"]
    return {"idle_p50_ms": round(1e3 * idle_p50_s, 2), "slowest": rows, "over_2x_idle_p50": len(over),
            "over_2x_at_s_ms": over[:40], "phases": {k: _stats(v) for k, v in phases.items()},
            "cores_over_flood": sampler.window(t0, end), "last_open_s": flood.get("last_open_s"),
            "phases_hint": f"start: the first {2 * BIN_S:g} s; burst: >= {BURST} opens + closes in its bins"}


NETSTAT = ("ListenOverflows", "ListenDrops", "TCPReqQFullDrop", "SyncookiesSent", "SyncookiesRecv",
           "TCPDeferAcceptDrop", "TW")


def netstat() -> dict[str, int]:
    """The machine's TCP counters of the listen queues (/proc/net/netstat; every process's, not the shard's alone)."""
    try:
        with open("/proc/net/netstat") as f:
            rows = [ln.split() for ln in f if ln.startswith("TcpExt:")]
        return {k: int(v) for k, v in zip(rows[0][1:], rows[1][1:]) if k in NETSTAT}
    except (OSError, IndexError, ValueError):
        return {}
