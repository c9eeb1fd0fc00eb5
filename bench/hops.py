"""Where a streamed token's time goes between the engine and the SSE bytes, hop by hop, at low load on CPU
(issue 18 item 2): flame's front door against `serve-http` (our engine alone over HTTP), with the tiny model.

One request at a time, the same prompts shape on every path, the paths interleaved request by request:

- `serve-http`: HTTP + SSE straight over one AsyncEngine (the reference),
- `door`: flame's front door (HTTP actor -> Python client -> router call -> engine actor's `stream`),
- `client`: the same Python client in this process (no front door, no HTTP),
- `actor`: this process calls the engine actor's `stream` itself (no router call, no client loop, no credit),
- `router`: the router's `route` call alone; `ray`: a bare actor call (`health`) for scale,
- the non-streamed answers of one token: `serve-http` / `door` over HTTP, `client.agenerate`, `actor.submit`.

The engine's own figures come back in the stream's result (queue_s: admission wait; ttft: arrival in the engine to
its first token). Per hop (p50 of TTFT differences): engine TTFT; actor admission; the Ray streaming hop (actor
TTFT - engine TTFT - admission); the client layer (client - actor: router call, credit, loop hand-offs); the front
door (door - client: HTTP, the door actor, its hand-off from the client loop, SSE); total overhead (door -
serve-http). Inter-token gaps per path (p50 / p99) and tokens per chunk (chunk merging). The client path's TTFT is
also split by the time.time() stamps its stream result carries (client_stream's route_s, credit_wait_s, sent_at,
first_chunk_at_client; the engine actor's arrived_at, first_chunk_at): the Ray hop's two directions apart.

The door and the Python client run with the ClientConfig fields of --client-json. --ab-json adds variants measured
in the same run: each its own door and client (`door[name]`, `client[name]`) over the same shard, interleaved with
the base paths request by request, and summarised as the median of paired TTFT differences from the base (a
one-flag A/B that the machine's drift cannot tilt).

    RAY_ADDRESS= python -m bench.hops --requests 40 --output-tokens 32 --out hops.json
    RAY_ADDRESS= python -m bench.hops --requests 60 --ab-json '{"global": {"local_routing": false}}'
    RAY_ADDRESS= python -m bench.hops --requests 60 --client-json '{"stream_transport": "ray"}' \
        --ab-json '{"socket": {"stream_transport": "socket"}}'

With ClientConfig.stream_transport "socket" the split's "Ray request hop" and "Ray return hop" are the socket's:
the OPEN frame from the client to the shard's stream_items running, the first CHUNK frame back to the client loop.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import aiohttp
import numpy as np

from bench.http_client import SERVED_MODEL_NAME
from bench.http_system import free_port
from bench.loadgen import Outcome, percentiles, stream_one
from bench.provenance import write_json

log = logging.getLogger(__name__)


def _setup(a):
    from bench.runner import RunOptions, build_setup

    o = RunOptions(model=a.model, load_format="auto", num_shards=1, max_model_len=a.max_model_len,
                   max_num_seqs=16, max_num_batched_tokens=a.max_model_len, torch_threads=a.torch_threads,
                   engine_json={"cpu_kvcache_gib": 0.25, **json.loads(a.engine_json)})
    return build_setup(o, os.path.join(a.logs, "logs"))


@dataclass(slots=True)
class Variant:
    """One client configuration under test: its own front door and Python client over the same shard."""
    name: str  # "" for the base paths (--client-json), else the --ab-json key (its paths read door[name] etc.)
    door: str  # the door's URL
    door_handle: object
    client: object


class Paths:
    """The measured paths over one started flame (1 CPU shard) and one serve-http."""

    def __init__(self, flame, http, revision: str, out_tokens: int, variants: dict[str, dict]) -> None:
        from flame_llm.sampling_params import SamplingParams

        self.flame, self.http, self.revision = flame, http, revision
        self.variants = [self._variant(flame, name, fields) for name, fields in variants.items()]
        self.engine_url = http.http_replicas()[0].url
        self.actor = next(iter(flame.service.actors.values()))
        self.sp = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
        self.sp1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        self.n = 0

    @staticmethod
    def _variant(flame, name: str, fields: dict) -> Variant:
        """A front door and a Python client with these ClientConfig fields (each door under its own actor name)."""
        from flame_llm.serving.client import make_client
        from flame_llm.serving.frontdoor import FRONTDOOR_NAME, start_frontdoor
        from flame_llm.serving.http_app import HttpConfig
        from flame_llm.serving.service_config import ClientConfig

        config = ClientConfig(**fields)
        http = HttpConfig(port=free_port(), served_model_name=SERVED_MODEL_NAME)
        handle, url = start_frontdoor(flame.namespace, http, client=config, name=f"{FRONTDOOR_NAME}-hops{name}")
        client = make_client(None, flame.service.router, flame.service.actors, namespace=flame.namespace, **fields)
        return Variant(name, url, handle, client)

    def close(self) -> None:
        import ray

        for v in self.variants:
            v.client.close()
            ray.kill(v.door_handle, no_restart=True)

    def _payload(self, prompt, sp) -> bytes:
        from flame_llm.protocol.types import Request
        from flame_llm.protocol.wire import encode_requests

        self.n += 1
        return encode_requests([Request(f"hops-{self.n}", np.asarray(prompt, dtype=np.uint32), sp)], self.revision)

    async def http_stream(self, session, url: str, prompt) -> dict:
        out = Outcome(0.0, 0, 0)
        await stream_one(session, url, prompt, self.sp.max_tokens, out, time.perf_counter(), SERVED_MODEL_NAME)
        assert out.error is None, out.error
        return {"ttft": out.ttft_s, "chunks": out.chunk_s, "tokens": out.output_tokens}

    async def client_stream(self, v: Variant, prompt) -> dict:
        t0, wall0 = time.perf_counter(), time.time()
        chunks, tokens, first_at, timings = [], 0, None, {}
        async for c in v.client.stream_chunks(prompt, self.sp):
            if c.token_ids:
                chunks.append(time.perf_counter() - t0)
                first_at = first_at or time.time()
                tokens += len(c.token_ids)
            if c.result is not None:
                assert c.result.error is None, c.result.error
                timings = c.result.timings
        return {"ttft": chunks[0], "chunks": chunks, "tokens": tokens, "split": split_of(timings, wall0, first_at)}

    async def actor_stream(self, prompt) -> dict:
        from flame_llm.protocol.wire import decode_results

        payload = self._payload(prompt, self.sp)
        t0 = time.perf_counter()
        chunks, tokens, res = [], 0, None
        async for ref in self.actor.stream.remote(payload, None):
            item = await ref
            if isinstance(item, list):
                chunks.append(time.perf_counter() - t0)
                tokens += len(item)
            else:
                (res,) = decode_results(item)
        assert res is not None and res.error is None, res
        return {"ttft": chunks[0], "chunks": chunks, "tokens": tokens, "engine_ttft": res.timings.get("ttft"),
                "queue": res.timings.get("queue_s")}

    async def router_call(self, prompt) -> dict:
        from flame_llm.protocol.routing_key import RouteItem, estimate_prefill_work, prefix_chain

        item = RouteItem(prefix_chain(prompt, self.revision), estimate_prefill_work(len(prompt)), 1)
        t0 = time.perf_counter()
        await self.flame.service.router.route.remote([item], [])
        t1 = time.perf_counter()
        await self.actor.health.remote()
        return {"router": t1 - t0, "ray": time.perf_counter() - t1}

    async def http_once(self, session, url: str, prompt) -> dict:
        """A one-token answer in one piece: its time, and the engine's TTFT when the response says (our servers'
        `flame` block)."""
        body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                "ignore_eos": True}
        t0 = time.perf_counter()
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            out = await resp.json()
            assert resp.status == 200, resp.status
        return {"e2e": time.perf_counter() - t0, "engine_ttft": (out.get("flame") or {}).get("ttft")}

    async def client_once(self, prompt) -> float:
        t0 = time.perf_counter()
        (r,) = await self.variants[0].client.agenerate([prompt], self.sp1)
        assert r.error is None, r.error
        return time.perf_counter() - t0

    async def actor_once(self, prompt) -> float:
        payload = self._payload(prompt, self.sp1)
        t0 = time.perf_counter()
        await self.actor.submit.remote(payload, None)
        return time.perf_counter() - t0


SPLIT = {  # the client path's TTFT in pieces, from the stream result's time.time() stamps (one host clock)
    "client: prepare, hand-off to the client loop (sent_at - call - route - credit)": "pre",
    "router call or local placement (route_s)": "route_s",
    "flow-control credit wait (credit_wait_s)": "credit_wait_s",
    "Ray request hop: stream call to the actor method running (arrived_at - sent_at)": "request_hop",
    "actor: decode, admission, engine to the first chunk (first_chunk_at - arrived_at)": "actor",
    "Ray return hop: first chunk to the client loop (first_chunk_at_client - first_chunk_at)": "return_hop",
    "client loop to the caller (caller's first chunk - first_chunk_at_client)": "to_caller",
}


def split_of(t: dict, call_at: float, caller_first_at: float | None) -> dict | None:
    """The SPLIT pieces of one streamed request (seconds), or None when its result lacks a stamp."""
    need = ("route_s", "credit_wait_s", "sent_at", "arrived_at", "first_chunk_at", "first_chunk_at_client")
    if caller_first_at is None or any(k not in t for k in need):
        return None
    return {"pre": t["sent_at"] - call_at - t["route_s"] - t["credit_wait_s"], "route_s": t["route_s"],
            "credit_wait_s": t["credit_wait_s"], "request_hop": t["arrived_at"] - t["sent_at"],
            "actor": t["first_chunk_at"] - t["arrived_at"],
            "return_hop": t["first_chunk_at_client"] - t["first_chunk_at"],
            "to_caller": caller_first_at - t["first_chunk_at_client"]}


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
        "Ray streaming hop + payload decode (actor - engine - admission)": p50["actor"] - eng - adm,
        "client layer: router call, credit, client-loop hand-offs (client - actor)": p50["client"] - p50["actor"],
        "front door: HTTP, door actor, hand-off from the client loop, SSE (door - client)": p50["door"] - p50["client"],
        "serve-http's own HTTP + SSE (serve-http - engine)": p50["serve-http"] - eng,
    }
    d, e = out["paths"]["door"], out["paths"]["serve-http"]
    out["goals"] = {"ttft_p50_overhead_ms": d["ttft_ms"]["p50"] - e["ttft_ms"]["p50"],
                    "ttft_p50_overhead_goal_ms": 3.0,
                    "itl_p99_ratio": d["itl_ms"]["p99"] / e["itl_ms"]["p99"] if e["itl_ms"] else None,
                    "itl_p99_ratio_goal": 1.2}
    out["ab"] = {}  # each --ab-json variant against the base paths of the same run (requests interleaved)
    for door in (k for k in streamed if k.startswith("door[")):
        name, d = door[len("door["):-1], out["paths"][door]
        paired = {}  # median over the run's rounds of (variant - base) TTFT, each round's requests back to back
        for path in ("door", "client"):
            pairs = [b["ttft"] - a["ttft"] for a, b in zip(samples[path], samples[f"{path}[{name}]"])]
            paired[path] = float(np.median(pairs)) * ms
        out["ab"][name] = {"ttft_p50_overhead_ms": d["ttft_ms"]["p50"] - e["ttft_ms"]["p50"],
                           "itl_p99_ratio": d["itl_ms"]["p99"] / e["itl_ms"]["p99"] if e["itl_ms"] else None,
                           "paired_ttft_diff_ms": paired}
    return out


def table(r: dict) -> str:
    lines = ["| path | TTFT p50 / p99 (ms) | inter-token p50 / p99 (ms) | tokens per chunk | 1-token answer p50 (ms) |",
             "|---|---|---|---|---|"]
    for k, v in r["paths"].items():
        once = r["once_ms"].get(k)
        lines.append(f"| {k} | {v['ttft_ms']['p50']:.2f} / {v['ttft_ms']['p99']:.2f} | {v['itl_ms']['p50']:.2f} / "
                     f"{v['itl_ms']['p99']:.2f} | {v['tokens_per_chunk']:.2f} | "
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
                     f"{v['itl_p99_ratio']:.2f}x; paired TTFT difference from the base (median, ms): "
                     + ", ".join(f"{k} {x:+.2f}" for k, x in v["paired_ttft_diff_ms"].items()))
    g = r["goals"]
    lines += ["", f"TTFT p50 overhead of the door over serve-http: {g['ttft_p50_overhead_ms']:.2f} ms (goal <= 3); "
              f"inter-token p99 door / serve-http: {g['itl_p99_ratio']:.2f}x (goal <= 1.2)"]
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
                   help='ClientConfig fields of the door\'s and the Python path\'s client, e.g. \'{"local_routing": '
                        'false}\'')
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
    from bench.runner import local_ray_scope
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
