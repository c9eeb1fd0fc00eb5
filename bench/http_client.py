"""The sticky-prefix HTTP client that drives the `engine` and `vllm` systems.

It places requests exactly as the service does: the router's own policy module (`RouterPolicy`) over
the one prefix chain (`prefix_chain`, seeded with the same model revision) and the same work estimates,
one routing call for the released burst, completions fed back with the cached-token counts the replicas
report. Replica k is the process pinned to the GPU of flame's shard k. The HTTP session (connection pool,
one health call per replica) is prepared before any timed burst.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from bench.burst.traces import TraceRequest
from flame_llm.protocol.errors import ErrorCode, ErrorInfo
from flame_llm.protocol.routing_key import RouteItem, estimate_prefill_work, prefix_chain
from flame_llm.protocol.types import Result
from router.policy import RouterConfig, RouterPolicy

SERVED_MODEL_NAME = "bench"  # the model name every benchmarked HTTP server serves under


@dataclass(slots=True)
class Replica:
    shard: int
    url: str  # base URL, e.g. http://127.0.0.1:8100
    device: str  # the GPU UUID it is pinned to (or cpu-k)


class StickyHttpClient:
    def __init__(self, replicas: list[Replica], model_revision: str, policy: str = "cumulative",
                 spill_factor: float = 1.25, model_name: str = SERVED_MODEL_NAME, return_token_ids: bool = False,
                 timeout_s: float = 3600.0):
        if [r.shard for r in replicas] != list(range(len(replicas))):
            raise ValueError(f"replicas must be shards 0..{len(replicas) - 1} in order; got "
                             f"{[r.shard for r in replicas]}")
        self.replicas, self.model_revision, self.model_name = replicas, model_revision, model_name
        self.policy = RouterPolicy(len(replicas), RouterConfig(policy, spill_factor))
        self.return_token_ids, self.timeout_s = return_token_ids, timeout_s
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> list[dict]:
        """Create the session and call /health on every replica (not timed); their answers, in order."""
        # idle connections close on our side first (uvicorn, under vLLM, drops them after 5 s): a request never
        # goes out on a connection the server is closing
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
        self.session = aiohttp.ClientSession(connector=connector, json_serialize=json.dumps,
                                             timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return [await self._health(r) for r in self.replicas]

    async def _health(self, r: Replica) -> dict:
        async with self.session.get(f"{r.url}/health") as resp:
            text = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"replica {r.shard} at {r.url}: /health answered {resp.status}: {text[:200]}")
            try:
                return json.loads(text) if text.strip() else {}
            except json.JSONDecodeError:
                return {}

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def run_burst(self, requests: list[TraceRequest], max_tokens: int) -> tuple[float, list[dict]]:
        """Release every request at once; (release perf_counter, one record per request in input order).
        Everything from routing to the last parsed response is inside the burst."""
        assert self.session is not None, "open() first"
        t_release = time.perf_counter()
        items = [RouteItem(prefix_chain(r.token_ids, self.model_revision), estimate_prefill_work(len(r.token_ids)),
                           r.max_tokens or max_tokens) for r in requests]  # the decode trace: each its own length
        shards = self.policy.route_batch(items)
        records = await asyncio.gather(*(self._one(r, s, it[1], it[2], t_release)
                                         for r, s, it in zip(requests, shards, items, strict=True)))
        return t_release, list(records)

    async def _one(self, req: TraceRequest, shard: int, est_work: float, max_tokens: int,
                   t_release: float) -> dict:
        rep = self.replicas[shard]
        body = {"model": self.model_name, "prompt": req.token_ids.tolist(), "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        if self.return_token_ids:
            body["return_token_ids"] = True
        res = Result(req.rid, shard=shard, device=rep.device)
        t_sent = time.perf_counter()
        try:
            async with self.session.post(f"{rep.url}/v1/completions", json=body) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            res.error = ErrorInfo(ErrorCode.HTTP_ERROR, f"{type(e).__name__}: {e}")
            return _record(res, time.perf_counter() - t_release)
        t_done = time.perf_counter()
        res.timings = {"sent_s": t_sent - t_release, "http_s": t_done - t_sent}
        try:
            out = json.loads(raw)
        except json.JSONDecodeError:
            out = {}
        if status != 200 or not out.get("choices"):
            msg = (out.get("error") or {}).get("message") if isinstance(out.get("error"), dict) else None
            res.error = ErrorInfo(ErrorCode.HTTP_ERROR, f"HTTP {status}: {msg or raw[:300].decode(errors='replace')}")
            return _record(res, t_done - t_release)
        rec = parse_completion(out, res, t_done - t_release)
        self.policy.complete(shard, est_work, max_tokens, res.prompt_tokens, res.cached_tokens)
        return rec

    def stats(self) -> dict:
        return self.policy.stats()


async def sse_chunks(resp: aiohttp.ClientResponse):
    """The JSON chunks of an OpenAI server-sent event stream, up to [DONE]."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def _record(res: Result, done_s: float, output_len: int = 0, cached_reported: bool = False) -> dict:
    """The bench's record of one request: the protocol's result dict plus when it completed."""
    return {**res.to_dict(), "output_len": output_len, "cached_reported": cached_reported, "done_s": done_s}


def parse_completion(out: dict, res: Result, done_s: float) -> dict:
    """The record of an OpenAI-style completions response (ours or vLLM's)."""
    choice = out["choices"][0]
    usage = out.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    ids = choice.get("token_ids")
    res.prompt_tokens = int(usage.get("prompt_tokens", 0))
    res.cached_tokens = int(details.get("cached_tokens") or 0)
    if ids is not None:
        res.output_token_ids = ids
    res.finish_reason = choice.get("finish_reason")
    ext = out.get("flame")
    if ext:  # our server: placement as the process saw it, the digest of the prompt it served, timings
        res.device = ext.get("device", res.device)
        res.node = ext.get("node", "")
        res.prompt_digest = (ext.get("prompt_digests") or [""])[0]
        res.timings.update({k: ext[k] for k in ("server_s", "ttft", "tpot") if ext.get(k) is not None})
    output_len = len(ids) if ids is not None else int(usage.get("completion_tokens", 0))
    return _record(res, done_s, output_len, details.get("cached_tokens") is not None)
