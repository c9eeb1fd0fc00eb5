"""Where a streamed token's time goes between the engine and the SSE bytes, hop by hop, at low load on CPU
(issue 18 item 2): flame's front door against `serve-http` (our engine alone over HTTP), with the tiny model.

One request at a time, the same prompts shape on every path, the paths interleaved request by request:

- `serve-http`: HTTP + SSE straight over one AsyncEngine (the reference),
- `door`: flame's front door (HTTP actor -> Python client -> router call -> engine actor's stream server),
- `client`: the same Python client in this process (no front door, no HTTP),
- `actor`: this process streams from the engine actor's stream server (no router call, no client loop, no credit),
- `router`: the router's `route` call alone; `ray`: a bare actor call (`health`) for scale,
- the non-streamed answers of one token: `serve-http` / `door` over HTTP, `client.agenerate`, the actor's socket
  (a BATCH frame of one).

The engine's own figures come back in the stream's result (queue_s: admission wait; ttft: arrival in the engine to
its first token). Per hop (p50 of TTFT differences): engine TTFT; actor admission; the stream socket hop (actor
TTFT - engine TTFT - admission); the client layer (client - actor: router call, credit, loop hand-offs); the front
door (door - client: HTTP, the door actor, its hand-off from the client loop, SSE); total overhead (door -
serve-http). Inter-token gaps per path (p50 / p99) and tokens per chunk (chunk merging). The client path's TTFT is
also split by the time.time() stamps its stream result carries (client_stream's route_s, credit_wait_s, sent_at,
first_chunk_at_client; the engine actor's arrived_at, first_chunk_at): the Ray hop's two directions apart.

The door and the Python client run with the ClientConfig fields of --client-json. --ab-json adds variants measured
in the same run: each its own door and client (`door[name]`, `client[name]`) over the same shard, interleaved with
the base paths request by request, and summarised as the median of paired TTFT differences from the base (a
one-flag A/B that the machine's drift cannot tilt).

    RAY_ADDRESS= python -m bench.service.hops --requests 40 --output-tokens 32 --out hops.json
    RAY_ADDRESS= python -m bench.service.hops --requests 60 --ab-json '{"window0": {"batch_window_ms": 0}}'

The split's "Ray request hop" and "Ray return hop" are the socket's:
the OPEN frame from the client to the shard's stream_items running, the first CHUNK frame back to the client loop.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

import aiohttp
import numpy as np

from bench.load.loadgen import percentiles
from bench.provenance import write_json
from bench.service.hop_paths import SPLIT, Paths

log = logging.getLogger(__name__)


def _setup(a):
    from bench.burst.runner import RunOptions, build_setup

    o = RunOptions(model=a.model, load_format="auto", num_shards=1, max_model_len=a.max_model_len,
                   max_num_seqs=16, max_num_batched_tokens=a.max_model_len, torch_threads=a.torch_threads,
                   engine_json={"cpu_kvcache_gib": 0.25, **json.loads(a.engine_json)})
    return build_setup(o, os.path.join(a.logs, "logs"))


async def measure(p: Paths, n: int, prompt_tokens: int, vocab: int, warmup: int, gap_s: float) -> dict:
    rng = np.random.default_rng(0)
    samples: dict[str, list] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)) as s:
        for i in range(warmup + n):
            runs = {"serve-http": lambda q: p.http_stream(s, p.engine_url, q)}
            for v in p.variants:  # the base paths, then each --ab-json variant's: door[B], client[B]
                tag = f"[{v.name}]" if v.name else ""
                runs |= {f"door{tag}": lambda q, v=v: p.http_stream(s, v.door, q),
                         f"client{tag}": lambda q, v=v: p.client_stream(v, q)}
            runs |= {"actor": p.actor_stream, "rpc": p.router_call,
                     "once-serve-http": lambda q: p.http_once(s, p.engine_url, q),
                     "once-door": lambda q: p.http_once(s, p.variants[0].door, q), "once-client": p.client_once,
                     "once-actor": p.actor_once}
            order = list(runs)
            order = order[i % len(order):] + order[:i % len(order)]  # rotate: no path always runs first
            for k in order:
                prompt = rng.integers(0, vocab, prompt_tokens).tolist()  # fresh: no prefix-cache hit anywhere
                got = await runs[k](prompt)
                if i >= warmup:
                    samples.setdefault(k, []).append(got)
                await asyncio.sleep(gap_s)
    return samples


def summarize(samples: dict) -> dict:
    ms = 1e3

    def pct(xs) -> dict:
        return {k: v * ms if k != "n" else v for k, v in percentiles(list(xs)).items()}

    out: dict = {"paths": {}}
    streamed = [k for k in samples if k == "serve-http" or k.split("[")[0] in ("door", "client", "actor")]
    for k in streamed:
        xs = samples[k]
        gaps = [b - a for x in xs for a, b in zip(x["chunks"], x["chunks"][1:])]
        out["paths"][k] = {"ttft_ms": pct(x["ttft"] for x in xs), "itl_ms": pct(gaps),
                           "tokens_per_chunk": sum(x["tokens"] for x in xs) / sum(len(x["chunks"]) for x in xs)}
    act = samples["actor"]
    out["engine_ttft_ms"] = pct(x["engine_ttft"] for x in act if x["engine_ttft"] is not None)
    out["admission_ms"] = pct(x["queue"] for x in act if x["queue"] is not None)
    for path in (k for k in streamed if k.startswith("client")):
        splits = [x["split"] for x in samples[path] if x.get("split")]
        if splits:
            key = "client_split_ms" + path.removeprefix("client")
            out[key] = {name: pct(s[k] for s in splits) for name, k in SPLIT.items()}
    out["router_call_ms"] = pct(x["router"] for x in samples["rpc"])
    out["ray_call_ms"] = pct(x["ray"] for x in samples["rpc"])
    out["once_ms"] = {k.removeprefix("once-"): pct(x["e2e"] if isinstance(x, dict) else x for x in samples[k])
                      for k in samples if k.startswith("once-")}
    for k, path in (("engine_ttft_http_ms", "once-serve-http"), ("engine_ttft_door_ms", "once-door")):
        out[k] = pct(x["engine_ttft"] for x in samples[path] if x["engine_ttft"] is not None)
    p50 = {k: v["ttft_ms"]["p50"] for k, v in out["paths"].items()}
    eng, adm = out["engine_ttft_ms"]["p50"], out["admission_ms"]["p50"]
    out["hops_ttft_p50_ms"] = {
        "engine (arrival in the engine to its first token)": eng,
        "actor admission (queue_s)": adm,
        "stream socket hop + payload decode (actor - engine - admission)": p50["actor"] - eng - adm,
        "client layer: router call, credit, client-loop hand-offs (client - actor)": p50["client"] - p50["actor"],
        "front door: HTTP, door actor, hand-off from the client loop, SSE (door - client)": p50["door"] - p50["client"],
        "serve-http's own HTTP + SSE (serve-http - engine)": p50["serve-http"] - eng,
    }
    d, e = out["paths"]["door"], out["paths"]["serve-http"]
    out["goals"] = {"ttft_p50_overhead_ms": d["ttft_ms"]["p50"] - e["ttft_ms"]["p50"],
                    "ttft_p50_overhead_goal_ms": 3.0,
                    "itl_p99_ratio": itl_p99_ratio(d, e),
                    "itl_p99_ratio_goal": 1.2}
    out["ab"] = {}  # each --ab-json variant against the base paths of the same run (requests interleaved)
    for door in (k for k in streamed if k.startswith("door[")):
        name, d = door[len("door["):-1], out["paths"][door]
        paired = {}  # median over the run's rounds of (variant - base) TTFT, each round's requests back to back
        for path in ("door", "client"):
            pairs = [b["ttft"] - a["ttft"] for a, b in zip(samples[path], samples[f"{path}[{name}]"])]
            paired[path] = float(np.median(pairs)) * ms
        out["ab"][name] = {"ttft_p50_overhead_ms": d["ttft_ms"]["p50"] - e["ttft_ms"]["p50"],
                           "itl_p99_ratio": itl_p99_ratio(d, e),
                           "paired_ttft_diff_ms": paired}
    return out


def itl_p99_ratio(path: dict, base: dict) -> float | None:
    """Inter-token p99 of a path over the base's; None when either had no gaps (each answer came in one chunk,
    as short answers do when the CPU engine outruns the reader)."""
    return path["itl_ms"]["p99"] / base["itl_ms"]["p99"] if path["itl_ms"] and base["itl_ms"] else None


def _ms(d: dict, k: str) -> str:
    return f"{d[k]:.2f}" if d else "n/a"


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "n/a"


def table(r: dict) -> str:
    lines = ["| path | TTFT p50 / p99 (ms) | inter-token p50 / p99 (ms) | tokens per chunk | 1-token answer p50 (ms) |",
             "|---|---|---|---|---|"]
    for k, v in r["paths"].items():
        once = r["once_ms"].get(k)
        lines.append(f"| {k} | {v['ttft_ms']['p50']:.2f} / {v['ttft_ms']['p99']:.2f} | {_ms(v['itl_ms'], 'p50')} / "
                     f"{_ms(v['itl_ms'], 'p99')} | {v['tokens_per_chunk']:.2f} | "
                     + (f"{once['p50']:.2f} |" if once else "n/a |"))
    lines += ["", "| hop (TTFT, p50 differences) | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in r["hops_ttft_p50_ms"].items()]
    for name, k in (("router call alone", "router_call_ms"), ("bare Ray actor call (health)", "ray_call_ms"),
                    ("serve-http's engine TTFT, 1-token answers", "engine_ttft_http_ms"),
                    ("flame's engine TTFT, 1-token answers via the door", "engine_ttft_door_ms")):
        if r.get(k):
            lines.append(f"| {name} (p50 / p99) | {r[k]['p50']:.2f} / {r[k]['p99']:.2f} |")
    for key in (k for k in r if k.startswith("client_split_ms")):
        lines += ["", f"| the client{key.removeprefix('client_split_ms')} path's TTFT split (time.time() stamps) "
                  "| p50 / p99 ms |", "|---|---|"]
        lines += [f"| {k} | {v['p50']:.2f} / {v['p99']:.2f} |" for k, v in r[key].items()]
    for name, v in r.get("ab", {}).items():
        lines.append(f"variant {name}: TTFT p50 overhead {v['ttft_p50_overhead_ms']:.2f} ms, inter-token p99 ratio "
                     f"{_x(v['itl_p99_ratio'])}; paired TTFT difference from the base (median, ms): "
                     + ", ".join(f"{k} {x:+.2f}" for k, x in v["paired_ttft_diff_ms"].items()))
    g = r["goals"]
    lines += ["", f"TTFT p50 overhead of the door over serve-http: {g['ttft_p50_overhead_ms']:.2f} ms (goal <= 3); "
              f"inter-token p99 door / serve-http: {_x(g['itl_p99_ratio'])} (goal <= 1.2)"]
    return "\n".join(lines)


def switch_interval_everywhere(seconds: float, folder: str) -> None:
    """The GIL switch interval of this process and of every Python process it starts from now on: a thread that
    waits for the GIL (an event loop woken by the engine thread) waits up to this long (Python's default 5 ms)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(f"import sys\nsys.setswitchinterval({seconds!r})\n")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH", "")]))
    sys.setswitchinterval(seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=40, help="measured requests per path")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--gap-s", type=float, default=0.02, help="idle time between requests (low load)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--logs", default="/tmp/flame-hops")
    p.add_argument("--switch-interval-s", type=float, default=None,
                   help="experiment: sys.setswitchinterval in every process started here (serve-http, Ray workers) "
                        "through a sitecustomize on PYTHONPATH; default: Python's 5 ms")
    p.add_argument("--client-json", default="{}",
                   help='ClientConfig fields of the door\'s and the Python path\'s client, e.g. \'{"max_retries": '
                        '3}\'')
    p.add_argument("--ab-json", default="{}",
                   help='variants measured in the same run, interleaved with the base paths: {"name": {ClientConfig '
                        'fields}}; each gets its own door, client and actor path (door[name], ...)')
    p.add_argument("--engine-json", default="{}", help="engine fields of both serve-http and the shard, e.g. "
                   '\'{"handoff_wait_ms": 0.5}\'')
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.switch_interval_s is not None:
        switch_interval_everywhere(a.switch_interval_s, os.path.join(a.logs, "switch"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bench.burst.runner import local_ray_scope
    from bench.system_config import parse_system
    from bench.systems import make_system
    from flame_llm.config import load_hf_config

    setup = _setup(a)
    vocab = load_hf_config(setup.model).vocab_size
    with local_ray_scope():
        http = make_system(parse_system("engine"), setup, "hops-engine")
        flame = make_system(parse_system("flame"), setup, "hops-flame")
        try:
            http.start()
            flame.start()
            variants = {"": json.loads(a.client_json), **json.loads(a.ab_json)}
            paths = Paths(flame, http, setup.model_revision, a.output_tokens, variants)
            try:
                samples = asyncio.run(measure(paths, a.requests, a.prompt_tokens, vocab, a.warmup, a.gap_s))
            finally:
                paths.close()
        finally:
            flame.stop()
            http.stop()
    res = {"args": vars(a), **summarize(samples), "samples": samples}
    print(table(res))
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
