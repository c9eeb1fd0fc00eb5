"""The Python client: routes each formed batch with one router call, queues requests on per-shard
batchers, sends compressed payloads to the engine actors, retries what was rejected as overloaded
or lost with a dead actor, and returns results in input order.

All client work runs on one private event loop thread, so `generate` (sync) and `agenerate` (from
any asyncio loop) share the batchers and concurrent callers' requests coalesce into batches."""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid

import numpy as np
import ray
import zstandard
from ray.exceptions import RayActorError

from flame_llm.protocol.routing_key import estimate_prefill_work, prefix_chain
from flame_llm.protocol.wire import BATCH_OVERHEAD, WireRequest, decode_results, encode_requests, request_wire_size
from flame_llm.sampling_params import SamplingParams
from flame_llm.serving.batcher import Pending, ShardBatcher
from flame_llm.serving.service import Service, attach, find_service, start_service
from flame_llm.serving.service_config import ServiceConfig

log = logging.getLogger(__name__)
RETRYABLE = ("overloaded",)


class Client:
    def __init__(self, router, actors: dict[int, ray.actor.ActorHandle], model_revision: str,
                 max_batch_prompts: int = 128, batch_window_ms: float = 10.0, max_batch_bytes: int = 4 << 20,
                 zstd_level: int = 1, max_retries: int = 20, restart_timeout_s: float = 300.0,
                 model_dir: str | None = None, service=None, flush_formed: bool = True):
        assert actors, "a service has at least one shard"
        self.router, self.actors, self.model_revision = router, dict(actors), model_revision
        self.max_batch_bytes, self.zstd_level, self.max_retries = max_batch_bytes, zstd_level, max_retries
        self.restart_timeout_s, self.model_dir, self.service = restart_timeout_s, model_dir, service
        # a generate() call hands over a formed batch: send what it queued without waiting out the
        # window (False: only the 128-prompt / window / byte-budget rules flush, as in the seed)
        self.flush_formed = flush_formed
        self._ids = (f"{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())
        self._tokenizer = None
        self._incarnation: dict[int, str] = {}
        self._recovering: dict[int, asyncio.Future] = {}
        self.counters = {"batches": 0, "route_calls": 0, "retries": 0, "restarts_seen": 0,
                         # per-batch costs, summed: decoded (raw) vs compressed payload bytes, seconds
                         # in routing calls, request encoding and result decoding
                         "payload_raw_bytes": 0, "payload_wire_bytes": 0, "route_s": 0.0, "encode_s": 0.0,
                         "result_decode_s": 0.0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flame-client", daemon=True)
        self._thread.start()
        self.batchers = {s: ShardBatcher(s, self._send, max_batch_prompts, batch_window_ms / 1000.0,
                                         max_batch_bytes) for s in self.actors}
        for s, h in zip(self.actors, ray.get([a.health.remote() for a in self.actors.values()]), strict=True):
            self._incarnation[s] = h["incarnation"]

    @classmethod
    def connect(cls, namespace: str = "flame", address: str | None = "auto", **kwargs) -> Client:
        """A client of the service running in `namespace` of the Ray cluster at `address`."""
        attach(namespace, address)
        router, actors = find_service(namespace)
        return make_client(None, router, actors, **kwargs)

    @classmethod
    def for_service(cls, svc: Service, **kwargs) -> Client:
        """A client of a service this process started (closing it leaves the service running)."""
        return make_client(svc.cfg, svc.router, svc.actors, **kwargs)

    def generate(self, prompts: list, sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = False) -> list[dict]:
        fut = asyncio.run_coroutine_threadsafe(self._generate(prompts, sampling_params, use_tqdm), self._loop)
        return fut.result()

    async def agenerate(self, prompts: list, sampling_params: SamplingParams | list[SamplingParams]) -> list[dict]:
        fut = asyncio.run_coroutine_threadsafe(self._generate(prompts, sampling_params, False), self._loop)
        return await asyncio.wrap_future(fut)

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if self.service is not None:
            self.service.stop()
            self.service = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- on the client loop ---

    async def _generate(self, prompts: list, sampling_params, use_tqdm: bool) -> list[dict]:
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries; prompts has {len(prompts)}")
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        pend, routed = [], []
        for prompt, sp in zip(prompts, sampling_params, strict=True):
            tokens = self._tokens(prompt)
            bad = tokens if isinstance(tokens, str) else None
            if bad is not None:
                tokens = np.zeros(0, dtype=np.uint32)
            p = Pending(next(self._ids), tokens, sp, [], 0.0, request_wire_size(len(tokens), len(sp.stop_token_ids)),
                        loop.create_future())
            pend.append(p)
            if bad is not None:
                p.future.set_result(_error(p, "bad_prompt", bad))
            elif not len(tokens):
                p.future.set_result(_error(p, "empty_prompt", "prompt must hold at least 1 token; got 0"))
            elif p.wire_bytes + BATCH_OVERHEAD > self.max_batch_bytes:
                p.future.set_result(_error(p, "over_budget", f"request needs {p.wire_bytes} decoded bytes; "
                                                             f"max_batch_bytes is {self.max_batch_bytes}"))
            else:
                p.chain = prefix_chain(tokens, self.model_revision)
                p.est_work = estimate_prefill_work(len(tokens))
                routed.append(p)
        if routed:
            await self._route(routed)
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(pend), desc="requests")
            for p in pend:
                p.future.add_done_callback(lambda _: bar.update(1))
        results = await asyncio.gather(*(p.future for p in pend))
        if bar is not None:
            bar.close()
        t1 = time.perf_counter()
        for r in results:
            r["timings"]["client_s"] = t1 - t0
            if self._tokenizer is not None and r["error"] is None:
                r["text"] = self._tokenizer.decode(r["output_token_ids"])
        return results

    async def _route(self, batch: list[Pending]) -> None:
        self.counters["route_calls"] += 1
        t0 = time.perf_counter()
        try:
            shards = await self.router.route.remote([(p.chain, p.est_work, p.sampling.max_tokens) for p in batch])
        except Exception as e:  # the router is down: every request of the batch gets the error
            for p in batch:
                p.future.set_result(_error(p, "router_error", f"{type(e).__name__}: {e}"))
            return
        assert len(shards) == len(batch), "the router answers every request"
        self.counters["route_s"] += time.perf_counter() - t0
        for p, s in zip(batch, shards, strict=True):
            p.shard = s
            self.batchers[s].add(p)
        if self.flush_formed:
            for s in set(shards):
                self.batchers[s].flush("formed")

    async def _send(self, shard: int, batch: list[Pending]) -> None:
        try:
            await self._send_batch(shard, batch)
        except Exception as e:  # a bug or an unreadable result must not leave callers waiting forever
            log.exception("shard %d: batch of %d failed", shard, len(batch))
            for p in batch:
                if not p.future.done():
                    p.future.set_result(_error(p, "client_error", f"{type(e).__name__}: {e}"))

    async def _send_batch(self, shard: int, batch: list[Pending]) -> None:
        self.counters["batches"] += 1
        t0 = time.perf_counter()
        payload = encode_requests([WireRequest(p.rid, p.tokens, p.sampling) for p in batch], self.model_revision,
                                  self.zstd_level)
        t1 = time.perf_counter()
        c = self.counters
        c["encode_s"] += t1 - t0
        c["payload_wire_bytes"] += len(payload)
        c["payload_raw_bytes"] += zstandard.frame_content_size(payload)  # the msgpack size, from the header
        try:
            reply = await self.actors[shard].submit.remote(payload)
            t_dec = time.perf_counter()
            results = decode_results(reply)
            c["result_decode_s"] += time.perf_counter() - t_dec
        except RayActorError as e:
            log.warning("shard %d failed with %d requests in flight (%s); waiting for its restart",
                        shard, len(batch), type(e).__name__)
            if not await self._await_restart(shard):
                for p in batch:
                    p.future.set_result(_error(p, "shard_unavailable", f"shard {shard} died and did not come "
                                                                       f"back within {self.restart_timeout_s}s: {e}"))
                return
            # the restarted engine is cold and the router dropped its prefixes: route them again
            again = []
            for p in batch:
                p.attempts += 1
                if p.attempts > self.max_retries:  # a request that keeps killing shards stops here
                    p.future.set_result(_error(p, "shard_died", f"shard {shard} died while serving this "
                                                                f"request, {p.attempts} times: {e}"))
                else:
                    again.append(p)
            self.counters["retries"] += len(again)
            if again:
                await self._route(again)
            return
        t2 = time.perf_counter()
        if len(results) != len(batch):  # the actor could not read the batch: one record for all
            assert len(results) == 1 and results[0]["id"] is None, "one result per request or one batch error"
            results = [{**results[0], "id": p.rid} for p in batch]
        completions = []
        for p, r in zip(batch, results, strict=True):
            assert r["id"] in (p.rid, None), "results come back in input order"
            err = r["error"]
            if err is not None and err["code"] in RETRYABLE and p.attempts < self.max_retries:
                self._retry(p, err["retry_after_s"] or 0.0)
                continue
            r["id"] = p.rid
            r["timings"].update(encode_s=t1 - t0, roundtrip_s=t2 - t1, attempts=p.attempts + 1, done_at=t2)
            ok = err is None
            completions.append((shard, p.est_work, p.sampling.max_tokens, r["prompt_tokens"] if ok else 0,
                                r["cached_tokens"] if ok else 0))
            if not p.future.done():
                p.future.set_result(r)
        if completions:
            self.router.complete.remote(completions)

    def _retry(self, p: Pending, delay_s: float) -> None:
        p.attempts += 1
        self.counters["retries"] += 1
        asyncio.get_running_loop().call_later(delay_s, self.batchers[p.shard].add, p)

    async def _await_restart(self, shard: int) -> bool:
        """Wait until the shard's actor answers again (shared by every batch that saw it die); when it
        is a new incarnation, its engine is cold: the router drops the shard's prefixes."""
        fut = self._recovering.get(shard)
        if fut is None:
            fut = self._recovering[shard] = asyncio.ensure_future(self._restart_once(shard))
            fut.add_done_callback(lambda _: self._recovering.pop(shard, None))
        return await asyncio.shield(fut)

    async def _restart_once(self, shard: int) -> bool:
        deadline = time.monotonic() + self.restart_timeout_s
        while time.monotonic() < deadline:
            try:
                h = await asyncio.wait_for(self.actors[shard].health.remote(), timeout=10.0)
            except (RayActorError, asyncio.TimeoutError):
                await asyncio.sleep(0.2)
                continue
            if h["incarnation"] != self._incarnation[shard]:
                self._incarnation[shard] = h["incarnation"]
                self.counters["restarts_seen"] += 1
                await self.router.drop_shard.remote(shard)
            return True
        return False

    def _tokens(self, prompt) -> np.ndarray | str:
        """The prompt as uint32 token ids, or the reason it cannot be one."""
        if isinstance(prompt, str):
            return np.asarray(self._tokenize(prompt), dtype=np.uint32)
        arr = prompt if isinstance(prompt, np.ndarray) else np.asarray(prompt)
        if arr.ndim != 1 or arr.size and arr.dtype.kind not in "iu":
            return f"prompt must be text or a flat sequence of token ids; got dtype {arr.dtype}, shape {arr.shape}"
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
            return f"token ids must be in [0, 2**32); got min {int(arr.min())}, max {int(arr.max())}"
        return arr.astype(np.uint32, copy=False)

    def _tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            except Exception as e:
                raise ValueError(f"prompts are text but the model dir {self.model_dir!r} has no usable "
                                 f"tokenizer ({type(e).__name__}); pass token ids instead") from None
        return self._tokenizer.encode(text)


def _error(p: Pending, code: str, message: str) -> dict:
    return {"id": p.rid, "output_token_ids": [], "finish_reason": None, "prompt_tokens": len(p.tokens),
            "cached_tokens": 0, "shard": p.shard, "gpu_uuid": "", "node": "", "timings": {},
            "error": {"code": code, "message": message, "retry_after_s": None}}


def make_client(cfg: ServiceConfig | None, router: ray.actor.ActorHandle, actors: dict,
                service: Service | None = None, **kwargs) -> Client:
    """A client for the router and shards given; `cfg` supplies the batching options, the shards' health
    their model revision and payload budget. With `service`, closing the client stops that service."""
    health = ray.get([a.health.remote() for a in actors.values()])
    revisions = {h["model_revision"] for h in health}
    if len(revisions) != 1:
        raise RuntimeError(f"shards serve different model revisions: {sorted(revisions)}")
    opts = {}
    if cfg is not None:
        opts = {"max_batch_prompts": cfg.max_batch_prompts, "batch_window_ms": cfg.batch_window_ms,
                "max_batch_bytes": cfg.max_batch_bytes, "zstd_level": cfg.zstd_level,
                "max_retries": cfg.max_retries}
    opts.update(kwargs)
    budget = min(h["max_decoded_bytes"] for h in health)
    opts["max_batch_bytes"] = min(opts.get("max_batch_bytes", budget), budget)
    return Client(router, actors, revisions.pop(), model_dir=health[0]["model"], service=service, **opts)


def start_local(cfg: ServiceConfig, **client_kwargs) -> Client:
    """Start a service and return a Client that stops it on close()."""
    svc = start_service(cfg)
    return make_client(cfg, svc.router, svc.actors, service=svc, **client_kwargs)
