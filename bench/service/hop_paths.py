"""The paths bench/service/hops.py measures over one started flame (1 CPU shard) and one serve-http: each path's one
streamed request (serve-http and the front door over HTTP + SSE, the Python client, the engine actor's stream
server over a socket of its own), the router call alone, a bare actor call, and the non-streamed one-token answers."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from bench.http_client import SERVED_MODEL_NAME
from bench.http_system import free_port
from bench.load.loadgen import Outcome, stream_one


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
        self.conns = None  # this bench's own connection to the shard's stream server (made on its loop, first use)
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

    def _link(self):
        """This bench's own connection to the actor's stream server (its one request entry point)."""
        from flame_llm.serving.pending import ClientCounters
        from flame_llm.serving.stream_conn import ShardLink

        if self.conns is None:
            self.conns = ShardLink(0, {0: self.actor}, ClientCounters(), None, None)
        return self.conns

    async def actor_stream(self, prompt) -> dict:
        from flame_llm.protocol.wire import decode_results

        payload = self._payload(prompt, self.sp)
        t0 = time.perf_counter()
        chunks, tokens, res = [], 0, None
        async for item in self._link().stream_items(payload):
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
        from flame_llm.protocol.stream_frames import Frame

        payload = self._payload(prompt, self.sp1)
        t0 = time.perf_counter()
        conn = await self._link().connection()
        sid, q = conn.open(payload, None, None, Frame.BATCH)  # a batch of one: its one result payload
        item = await q.get()
        conn.done(sid)
        assert isinstance(item, bytes), item
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
