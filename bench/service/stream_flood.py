"""A connection flood against one engine actor's stream port (issue 37), on loopback only, bounded in connections and
time: `python -m bench.service.stream_flood --connections 20000` starts a one-shard tiny service on a local Ray,
measures
valid streams (a Client on the socket transport) idle, then while `--connections` silent connections are opened to
the shard's stream port as fast as `--concurrency` allows, then after; it prints the shard process's file
descriptors before, at peak and after, how long flood connections lived, and the valid streams' latency during the
flood against idle, and the server process's CPU over the flood per connection (the valid streams beside it
included), and how long a new valid connection takes to be answered idle and during the flood (a probe every 0.2 s).
`--accept-share` and `--defer-accept` set the shard's stream_accept_share and stream_defer_accept (an A/B).
`--target standalone` floods a StreamServer with stand-in streams in a child process instead
(no Ray; what tests/test_stream_flood.py runs at a smaller size)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from bench.service.flood_timeline import Sampler, bins, netstat, pid_of, slowest

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"


@dataclass(slots=True)
class FloodStats:
    opened: int = 0
    connect_failed: int = 0
    closed_by_peer: int = 0
    still_open: int = 0  # at the end of the hold: the server kept them
    max_life_s: float = 0.0  # the longest a flood connection lived before the server closed it
    duration_s: float = 0.0
    t0: float = 0.0  # time.monotonic() at the start (the same clock in every process of the machine)
    last_open_s: float = 0.0  # the last connect completed, seconds after t0
    opens: list = field(default_factory=list)  # connects completed per flood_timeline.BIN_S from t0
    closes: list = field(default_factory=list)  # connections the server closed, per bin


def fds_of(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


async def flood(port: int, n: int, concurrency: int, hold_s: float) -> FloodStats:
    """Open n silent connections to LOOPBACK:port, at most `concurrency` at a time; each is held until the server
    closes it or hold_s passes. Bounded: n connections, hold_s each."""
    assert n <= 100_000 and hold_s <= 120
    st, t0 = FloodStats(), time.monotonic()
    left, opened_at, closed_at = [n], [], []

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            await one()

    async def one() -> None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(LOOPBACK, port), 10)
        except (OSError, TimeoutError):
            st.connect_failed += 1
            return
        st.opened += 1
        opened = time.monotonic()
        opened_at.append(opened)
        try:
            await asyncio.wait_for(reader.read(), hold_s)
            st.closed_by_peer += 1
            closed_at.append(time.monotonic())
        except ConnectionError:
            st.closed_by_peer += 1
            closed_at.append(time.monotonic())
        except TimeoutError:
            st.still_open += 1
        st.max_life_s = max(st.max_life_s, time.monotonic() - opened)
        writer.transport.abort()

    await asyncio.gather(*(worker() for _ in range(min(n, concurrency))))
    st.duration_s = time.monotonic() - t0
    st.t0, st.last_open_s = t0, max(opened_at, default=t0) - t0
    st.opens, st.closes = bins(opened_at, t0), bins(closed_at, t0)
    return st


def cpu_s_of(pid: int) -> float:
    """User + system CPU seconds of a process so far (-1 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return -1.0


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": 1e3 * statistics.median(xs), "p90_ms": 1e3 * xs[int(0.9 * (len(xs) - 1))],
            "p99_ms": 1e3 * xs[int(0.99 * (len(xs) - 1))], "max_ms": 1e3 * xs[-1]}


async def _new_conn(ep) -> float:
    """Seconds from a new connection's connect to the server's first answer on it: the hello, then an OPEN whose
    payload is not bytes (answered FAIL at once, no engine work; counted in the shard's socket_bad_frames)."""
    from flame_llm.protocol.stream_frames import Frame, encode_frame, read_frame

    t = time.perf_counter()
    reader, writer = await asyncio.open_connection(LOOPBACK, ep.port)
    try:
        writer.write(encode_frame(Frame.HELLO, ep.token) + encode_frame(Frame.OPEN, 0, 0, None, None))
        frame = await read_frame(reader, 1 << 16)
        assert frame is not None and frame[0] == Frame.FAIL, frame
        return time.perf_counter() - t
    finally:
        writer.close()


async def _probes(ep, until: asyncio.Event | None, n: int) -> tuple[list[float], int]:
    """New connections one after another, 0.2 s apart: n of them, or until `until` is set; (latencies, failed)."""
    out, failed = [], 0
    for _ in range(10_000):
        if (until is None and len(out) + failed >= n) or (until is not None and until.is_set()):
            break
        try:
            out.append(await asyncio.wait_for(_new_conn(ep), 30))
        except (OSError, TimeoutError, AssertionError):
            failed += 1
        await asyncio.sleep(0.2)
    return out, failed


async def _valid(stream_once, until: asyncio.Event | None, n: int,
                 starts: list[float] | None = None) -> list[float]:
    """Latencies of valid streams one after another, 5 ms apart: n of them, or until `until` is set (at most
    100,000); each one's start (time.monotonic()) appended to `starts`."""
    out: list[float] = []
    for _ in range(100_000):
        if (until is None and len(out) >= n) or (until is not None and until.is_set()):
            break
        t, t_mono = time.perf_counter(), time.monotonic()
        await stream_once()
        out.append(time.perf_counter() - t)
        if starts is not None:
            starts.append(t_mono)
        await asyncio.sleep(0.005)
    return out


async def run(ep, pid: int, stream_once, args) -> dict:
    port = ep.port
    fds_before = fds_of(pid)
    cpus = Sampler({"shard": pid, "attacker": None, "door": pid_of("ray::FrontDoor"), "bench": os.getpid()})
    cpus_task = asyncio.ensure_future(cpus.run())
    await asyncio.sleep(0.2)
    idle_at = time.monotonic()
    idle = await _valid(stream_once, None, args.valid)
    idle_cores = cpus.window(idle_at, time.monotonic())
    new_idle, _ = await _probes(ep, None, 10)
    done, peak = asyncio.Event(), [fds_before]

    async def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], fds_of(pid))
            await asyncio.sleep(0.1)

    sampler = asyncio.ensure_future(sample())
    cpu0, starts, net0 = cpu_s_of(pid), [], netstat()
    during_task = asyncio.ensure_future(_valid(stream_once, done, 0, starts))
    probes_task = asyncio.ensure_future(_probes(ep, done, 0))
    # the flood runs in its own process: the valid streams' latency is the server's, not this loop's; optionally
    # niced and/or pinned, to tell the attacker's CPU (another machine's in a real attack) from the shard's
    prefix = (["nice", "-n", str(args.attacker_nice)] if args.attacker_nice else []) + \
        (["taskset", "-c", args.attacker_cpus] if args.attacker_cpus else [])
    proc = await asyncio.create_subprocess_exec(
        *prefix, sys.executable, "-m", "bench.service.stream_flood", "--flood-port", str(port),
        "--connections", str(args.connections),
        "--concurrency", str(args.concurrency), "--hold-s", str(args.hold_s), stdout=subprocess.PIPE)
    cpus.pids["attacker"] = proc.pid  # nice and taskset exec the interpreter: the same pid
    out, _ = await asyncio.wait_for(proc.communicate(), args.hold_s + 600)
    st = FloodStats(**json.loads(out))
    net = {k: v - net0.get(k, 0) for k, v in netstat().items()}
    cpu = cpu_s_of(pid) - cpu0  # the server's CPU over the flood (the valid streams beside it included)
    done.set()
    during = await during_task
    new_during, new_failed = await probes_task
    await sampler
    cpus.done.set()
    await cpus_task
    where = {"idle_cores": idle_cores, **slowest(list(zip(starts, during)), asdict(st), cpus, statistics.median(idle))}
    await asyncio.sleep(args.settle_s)
    return {"connections": args.connections, "flood": asdict(st), "fds_before": fds_before, "fds_peak": peak[0],
            "fds_after": fds_of(pid), "valid_idle": _percentiles(idle), "valid_during": _percentiles(during),
            "server_cpu_s": cpu, "server_cpu_us_per_conn": 1e6 * cpu / max(1, st.opened),
            "new_conn_idle": _percentiles(new_idle), "new_conn_during": {**_percentiles(new_during),
                                                                          "failed": new_failed},
            "accept_share": args.accept_share, "defer_accept": args.defer_accept,
            "refuse_reset": args.refuse_reset, "attacker_nice": args.attacker_nice,
            "attacker_cpus": args.attacker_cpus, "where": where, "netstat": net}


def _standalone(args, stderr=None) -> dict:
    """A StreamServer (stand-in streams: payload b"N" yields N chunks) in a child process (its log to `stderr`)."""
    child = subprocess.Popen([sys.executable, "-m", "bench.service.stream_flood_child", json.dumps(vars(args))],
                             stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        ep = json.loads(child.stdout.readline())
        from flame_llm.protocol.stream_frames import StreamEndpoint
        from flame_llm.serving.stream_conn import StreamConn

        async def main() -> dict:
            endpoint = StreamEndpoint(**ep)
            reader, writer = await asyncio.open_connection(LOOPBACK, endpoint.port)
            from flame_llm.protocol.stream_frames import Frame, encode_frame
            writer.write(encode_frame(Frame.HELLO, endpoint.token))
            conn = StreamConn(0, endpoint, reader, writer)

            async def once() -> None:
                _, q = conn.open(b"4", None, None)
                while not isinstance(await asyncio.wait_for(q.get(), 30), bytes):
                    pass

            try:
                return await run(endpoint, child.pid, once, args)
            finally:
                conn.close("done")

        out = asyncio.run(main())
    finally:
        out_alive = child.poll() is None
        child.terminate()
        child.wait(30)
    return {**out, "server_alive": out_alive}


def _service(args) -> dict:
    import ray

    from flame_llm import SamplingParams
    from flame_llm.serving.client import Client
    from flame_llm.serving.service import start_service
    from flame_llm.serving.service_config import ServiceConfig

    cfg = ServiceConfig.from_kwargs(model="tiny", num_shards=1, cpu_per_shard=1, namespace="bench-stream-flood",
                                    stream_hello_timeout_s=args.hello_timeout_s,
                                    stream_accept_share=args.accept_share, stream_defer_accept=args.defer_accept,
                                    stream_refuse_reset=args.refuse_reset)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # its own, on loopback
    svc = start_service(cfg)
    try:
        actor = svc.actors[0]
        ep = ray.get(actor.stream_endpoint.remote(ray.get_runtime_context().get_node_id()))
        assert ep.host == LOOPBACK, ep
        client = Client.for_service(svc)
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        door = _door(cfg) if args.door else None

        async def once() -> None:
            if door is not None:  # through the front door (its client streams over the same port)
                await asyncio.to_thread(door[1])
                return
            async for _ in client.stream_chunks([5, 6, 7, 8], sp):
                pass

        try:
            out = asyncio.run(run(ep, svc.health[0].pid, once, args))
            out["valid_via"] = "front door (HTTP /v1/completions, stream)" if door else "Client.stream_chunks (socket)"
        finally:
            client.close()
            if door is not None:
                from flame_llm.serving.frontdoor import stop_frontdoor
                stop_frontdoor(cfg.ray.namespace)
        out["shard"] = {k: v for k, v in ray.get(actor.stats.remote()).items() if k.startswith("socket_")}
        out["live"] = asdict(ray.get(actor.live.remote()))
        return out
    finally:
        svc.stop(timeout_s=10)
        ray.shutdown()


def _door(cfg):
    """The service's front door on a free loopback port, and a function that sends one 8-token completion, streamed
    (SSE: the door's client streams it over the shard's stream port)."""
    import http.client
    from urllib.parse import urlparse

    from flame_llm.serving.frontdoor import start_frontdoor
    from flame_llm.serving.http_app import HttpConfig

    handle, address = start_frontdoor(cfg.ray.namespace, HttpConfig(host=LOOPBACK, port=0), client=cfg.client)
    url = urlparse(address)

    def call(method: str, path: str, body: dict | None = None) -> dict:
        c = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        try:
            c.request(method, path, json.dumps(body) if body else None, {"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
            assert r.status == 200 and (not body or b"[DONE]" in data), (r.status, data[:200])
            return json.loads(data) if not body else {}
        finally:
            c.close()

    model = call("GET", "/v1/models")["data"][0]["id"]
    return handle, lambda: call("POST", "/v1/completions", {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 8,
                                                            "temperature": 0, "ignore_eos": True, "stream": True})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=1000, help="flood connections open at once, at most")
    p.add_argument("--hold-s", type=float, default=20.0, help="a flood connection is held at most this long")
    p.add_argument("--hello-timeout-s", type=float, default=5.0, help="the shard's stream_hello_timeout_s")
    p.add_argument("--valid", type=int, default=20, help="valid streams measured idle")
    p.add_argument("--accept-share", type=float, default=0.25, help="the shard's stream_accept_share")
    p.add_argument("--defer-accept", choices=("on", "off"), default="on", help="the shard's stream_defer_accept")
    p.add_argument("--refuse-reset", choices=("on", "off"), default="off", help="the shard's stream_refuse_reset")
    p.add_argument("--attacker-nice", type=int, default=0, help="run the flood process under nice -n N")
    p.add_argument("--attacker-cpus", default="", help="pin the flood process to these CPUs (taskset -c)")
    p.add_argument("--settle-s", type=float, default=6.0, help="wait after the flood before counting fds")
    p.add_argument("--target", choices=("service", "standalone"), default="service")
    p.add_argument("--door", action="store_true", help="valid requests through the front door (HTTP), not a Client")
    p.add_argument("--flood-port", type=int, help=argparse.SUPPRESS)  # the flood process's own run
    args = p.parse_args(argv)
    args.defer_accept, args.refuse_reset = args.defer_accept == "on", args.refuse_reset == "on"
    logging.basicConfig(level=logging.WARNING)
    if args.flood_port:
        print(json.dumps(asdict(asyncio.run(flood(args.flood_port, args.connections, args.concurrency,
                                                  args.hold_s)))))
        return 0
    out = _service(args) if args.target == "service" else _standalone(args)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
