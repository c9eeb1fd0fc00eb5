"""A burst ten times what the shards admit, against the same burst with ample admission bounds (issue 14, 4).

Each round starts a fresh service on a local Ray (the tiny model on CPU shards unless --model says otherwise)
for each of three settings, interleaved: ample bounds; the tight bounds (the client's flow control keeps what
it sends within them; the setting without it was retired with the client's flow_control switch, issue 38); the
tight in-flight bound with an ample queue (the ceiling: an in-flight bound below the engine's max_num_seqs
makes its batches smaller, whatever admission does). Each is warmed with one small
batch, then one generate() of --prompts prompts is timed. The report is each setting's wall time, its
throughput relative to ample bounds in the same round (1.0: overload costs nothing) and what the shards and
the client counted (rejections, retries, the most attempts one request needed).

    python -m bench.load.overload --prompts 640 --prompt-len 128 --max-tokens 32 --tight 16,16 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import numpy as np
import ray
from tqdm import tqdm

from actors.shard_options import ShardOptions
from flame_llm.sampling_params import SamplingParams
from flame_llm.serving.client import Client
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ServiceConfig

log = logging.getLogger(__name__)
_SHARD = ShardOptions()
AMPLE = (_SHARD.max_inflight_requests, _SHARD.max_queued_requests)  # the shard's default bounds


def one_round(args, name: str, bounds: tuple[int, int], prompts: list[list[int]], rnd: int) -> dict:
    cfg = ServiceConfig.from_kwargs(model=args.model, num_shards=args.shards, cpu_per_shard=0.5,
                                    namespace=f"overload-{rnd}-{name}",
                                    max_inflight_requests=bounds[0],
                                    max_queued_requests=bounds[1],
                                    engine={"max_model_len": 512, "max_num_batched_tokens": 512,
                                            "max_num_seqs": 16, "cpu_kvcache_gib": 0.0625})
    svc = start_service(cfg)
    client = Client.for_service(svc)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    try:
        client.generate(prompts[:4], sp)  # warm: first steps of each engine
        before = sum(ray.get(a.stats.remote())["rejected"] for a in svc.actors.values())
        retries0 = client.counters.retries
        t0 = time.perf_counter()
        res = client.generate(prompts, sp)
        wall = time.perf_counter() - t0
        rejected = sum(ray.get(a.stats.remote())["rejected"] for a in svc.actors.values()) - before
        errors = [r.error for r in res if r.error is not None]
        return {"setting": name, "bounds": list(bounds), "round": rnd,
                "wall_s": wall, "rejected": rejected, "credit_waits": client.counters.credit_waits,
                "retries": client.counters.retries - retries0, "errors": len(errors),
                "max_attempts": max(r.timings["attempts"] for r in res)}
    finally:
        client.close()
        svc.stop(timeout_s=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=320)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--tight", default="8,8", help="max_inflight_requests,max_queued_requests per shard")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (ample, tight), interleaved")
    ap.add_argument("--out", help="write the JSON record here")
    args = ap.parse_args(argv)
    tight = tuple(int(x) for x in args.tight.split(","))
    if len(tight) != 2 or min(tight) < 1:
        ap.error(f"--tight must be two integers >= 1 (in flight, queued); got {args.tight!r}")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=args.prompt_len).tolist() for _ in range(args.prompts)]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    settings = [("ample", AMPLE), ("tight", tight),
                # the tight in-flight bound with an ample queue: what any admission can reach with that bound
                ("tight-in-flight-only", (tight[0], AMPLE[1]))]
    rows = []
    try:
        for rnd in tqdm(range(args.rounds), desc="rounds"):
            for name, bounds in settings:
                rows.append(one_round(args, name, bounds, prompts, rnd))
    finally:
        ray.shutdown()
    wall = {name: [r["wall_s"] for r in rows if r["setting"] == name] for name, _ in settings}
    summary = {"prompts": args.prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
               "tight": list(tight), "ample": list(AMPLE),
               "median_wall_s": {k: statistics.median(v) for k, v in wall.items()},
               "throughput_vs_ample": {}, "rounds": rows}
    for name in wall:
        ratios = [a / w for a, w in zip(wall["ample"], wall[name], strict=True)]  # paired within a round
        summary["throughput_vs_ample"][name] = {"median": statistics.median(ratios), "min": min(ratios),
                                                "max": max(ratios)}
    text = json.dumps(summary, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
