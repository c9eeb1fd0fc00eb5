"""What each way of sending results back costs (issue 18 item 1): a batch's results at once (`submit`), each as
it finishes through one Ray streaming generator (`submit_streaming`, results finishing within the window
merged), or one actor call (and ref) per request. A stand-in actor finishes a batch's requests on an engine-like
schedule (`--group` requests every `--step-ms`) and answers with real result payloads (the wire codec); the
driver records, per request, the lag from its finish in the actor to its result in the caller's hands
(time.time() on one machine), and the CPU seconds the driver and the actor spent. No engine, no GPU.

    python -m bench.result_path --out bench/results/2026-12-01-cpu-results-as-finished/result_path.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time

import numpy as np
import ray

from actors.as_finished import as_finished
from flame_llm.protocol.types import Result
from flame_llm.protocol.wire import decode_results, encode_results

log = logging.getLogger("bench.result_path")
MODES = ("batch", "streaming", "per_request")


class Finisher:
    """Finishes request i of a batch at start + (i // group) * step_s; each result carries `tokens` ids."""

    def __init__(self, group: int, step_s: float, tokens: int, window_s: float) -> None:
        self.group, self.step_s, self.window_s = group, step_s, window_s
        self.ids = np.arange(tokens, dtype=np.uint32)

    async def _one(self, i: int, start: float) -> tuple[Result, float]:
        await asyncio.sleep(max(0.0, start + (i // self.group) * self.step_s - time.time()))
        return Result(f"r{i}", output_token_ids=self.ids, finish_reason="length", prompt_tokens=8), time.time()

    async def batch(self, n: int) -> tuple[bytes, list[float]]:
        start = time.time()
        done = await asyncio.gather(*(self._one(i, start) for i in range(n)))
        return encode_results([r for r, _ in done]), [t for _, t in done]

    @ray.method(num_returns="streaming")
    async def streaming(self, n: int):
        start = time.time()
        tasks = [asyncio.ensure_future(self._one(i, start)) for i in range(n)]
        async for group in as_finished(tasks, self.window_s):
            yield encode_results([r for r, _ in group]), [t for _, t in group]

    async def one(self, i: int, start: float) -> tuple[bytes, float]:
        r, t = await self._one(i, start)
        return encode_results([r]), t

    def cpu_s(self) -> float:
        return time.process_time()


async def _round(actor, mode: str, n: int, batches: int) -> list[float]:
    """`batches` concurrent batches of n requests: each request's lag (seconds) from its finish to the caller."""
    async def one_batch() -> list[float]:
        lags = []
        if mode == "batch":
            payload, finished = await actor.batch.remote(n)
            now = time.time()
            assert len(decode_results(payload)) == n
            lags += [now - t for t in finished]
        elif mode == "streaming":
            async for ref in actor.streaming.remote(n):
                payload, finished = await ref
                now = time.time()
                assert len(decode_results(payload)) == len(finished)
                lags += [now - t for t in finished]
        else:
            start = time.time()

            async def req(i):
                payload, t = await actor.one.remote(i, start)
                now = time.time()
                decode_results(payload)
                return now - t
            lags += await asyncio.gather(*(req(i) for i in range(n)))
        assert len(lags) == n
        return lags
    return [lag for b in await asyncio.gather(*(one_batch() for _ in range(batches))) for lag in b]


def measure(args) -> dict:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(Finisher).options(max_concurrency=4096).remote(args.group, args.step_ms / 1000.0,
                                                                            args.tokens, args.window_ms / 1000.0)
        loop = asyncio.new_event_loop()
        out = {}
        for mode in MODES:
            loop.run_until_complete(_round(actor, mode, args.requests, args.batches))  # warm
            lags, cpu_driver, cpu_actor, wall = [], 0.0, 0.0, 0.0
            for _ in range(args.rounds):
                a0, d0, w0 = ray.get(actor.cpu_s.remote()), time.process_time(), time.perf_counter()
                lags += loop.run_until_complete(_round(actor, mode, args.requests, args.batches))
                wall += time.perf_counter() - w0
                cpu_driver += time.process_time() - d0
                cpu_actor += ray.get(actor.cpu_s.remote()) - a0
            total = args.rounds * args.batches * args.requests
            q = np.quantile(lags, [0.5, 0.9, 0.99])
            out[mode] = {"lag_p50_ms": 1e3 * q[0], "lag_p90_ms": 1e3 * q[1], "lag_p99_ms": 1e3 * q[2],
                         "lag_mean_ms": 1e3 * statistics.fmean(lags), "wall_s": wall,
                         "driver_cpu_us_per_request": 1e6 * cpu_driver / total,
                         "actor_cpu_us_per_request": 1e6 * cpu_actor / total}
            log.info("%s: %s", mode, out[mode])
        loop.close()
        return out
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128, help="requests per batch")
    ap.add_argument("--batches", type=int, default=4, help="concurrent batches")
    ap.add_argument("--group", type=int, default=4, help="requests finishing together (one engine step)")
    ap.add_argument("--step-ms", type=float, default=10.0, help="between finishing groups")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per result")
    ap.add_argument("--window-ms", type=float, default=2.0, help="the streaming mode's coalescing window")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="write the JSON record here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = {"args": vars(args), "modes": measure(args)}
    print(f"{'mode':<12} {'lag p50 ms':>10} {'p90':>8} {'p99':>8} {'driver us/req':>14} {'actor us/req':>13} "
          f"{'wall s':>7}")
    for mode, m in res["modes"].items():
        print(f"{mode:<12} {m['lag_p50_ms']:>10.2f} {m['lag_p90_ms']:>8.2f} {m['lag_p99_ms']:>8.2f} "
              f"{m['driver_cpu_us_per_request']:>14.1f} {m['actor_cpu_us_per_request']:>13.1f} {m['wall_s']:>7.2f}")
    if args.out:
        import os
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
