"""The Python client: routes each formed batch with one router call, queues requests on per-shard
batchers, sends compressed payloads to the engine actors and returns results in input order, as the plain
dicts of flame_llm.protocol.types.Result.to_dict().

Prompts are checked against the limits every shard publishes before they are routed. A result whose error
is retryable (flame_llm.protocol.types.RETRYABLE) does not reach the caller while retries are left: an
overloaded shard's request goes back to it after its retry hint; a draining shard's requests, and those of
a shard that died and did not come back, are routed to the other shards (the client avoids that shard until
its health says it serves again); a router call lost with a restarting router is made again.

All client work runs on one private event loop thread, so `generate` (sync) and `agenerate` (from
any asyncio loop) share the batchers and concurrent callers' requests coalesce into batches."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
import uuid

import numpy as np
import ray
import zstandard
from ray.exceptions import RayActorError

from flame_llm.protocol.routing_key import Completion, RouteItem, estimate_prefill_work, prefix_chain
from flame_llm.protocol.types import (
    DEFAULT_ZSTD_LEVEL,
    EngineLimits,
    ErrorCode,
    ErrorInfo,
    Request,
    RequestError,
    Result,
)
from flame_llm.protocol.wire import BATCH_OVERHEAD, decode_results, encode_requests, request_wire_size
from flame_llm.sampling_params import SamplingParams
from flame_llm.serving.batcher import Pending, ShardBatcher
from flame_llm.serving.service import Service, attach, find_service, start_service
from flame_llm.serving.service_config import DEFAULT_NAMESPACE, ClientConfig, ServiceConfig
from flame_llm.serving.shard_watch import ShardWatch

log = logging.getLogger(__name__)
ROUTE_ATTEMPTS = 3  # router calls per batch: one lost with a restarting router is made again


class Client:
    def __init__(self, router, actors: dict[int, ray.actor.ActorHandle], model_revision: str,
                 config: ClientConfig | None = None, zstd_level: int = DEFAULT_ZSTD_LEVEL,
                 model_dir: str | None = None, service=None):
        assert actors, "a service has at least one shard"
        config = config or ClientConfig()
        self.config = config
        self.router, self.actors, self.model_revision = router, dict(actors), model_revision
        health = ray.get([a.health.remote() for a in self.actors.values()])
        self.limits = EngineLimits.tightest(health)  # what every shard accepts
        self.max_payload_bytes = self.limits.max_payload_bytes
        self.zstd_level, self.max_retries = zstd_level, config.max_retries
        self.restart_timeout_s, self.model_dir, self.service = config.restart_timeout_s, model_dir, service
        self.flush_formed = config.flush_formed
        self._ids = (f"{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())
        self._tokenizer = None
        self.counters = {"batches": 0, "route_calls": 0, "route_retries": 0, "retries": 0, "restarts_seen": 0,
                         # per-batch costs, summed: decoded (raw) vs compressed payload bytes, seconds
                         # in routing calls, request encoding and result decoding
                         "payload_raw_bytes": 0, "payload_wire_bytes": 0, "route_s": 0.0, "encode_s": 0.0,
                         "result_decode_s": 0.0}
        self.shards = ShardWatch(self.actors, router, health, config.restart_timeout_s, self.counters)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flame-client", daemon=True)
        self._thread.start()
        self.batchers = {s: ShardBatcher(s, self._send, config.max_batch_prompts, config.batch_window_ms / 1000.0,
                                         self.max_payload_bytes) for s in self.actors}

    @classmethod
    def connect(cls, namespace: str = DEFAULT_NAMESPACE, address: str | None = "auto", **kwargs) -> Client:
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
            asyncio.run_coroutine_threadsafe(self.shards.stop(), self._loop).result(timeout=5)
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
            p = Pending(Request(next(self._ids), np.zeros(0, dtype=np.uint32), sp), [], 0.0, 0, loop.create_future())
            pend.append(p)
            try:
                tokens = p.request.prompt_token_ids = self._tokens(prompt)
                p.wire_bytes = request_wire_size(len(tokens), len(sp.stop_token_ids))
                self.limits.check_prompt(tokens)
                if p.wire_bytes + BATCH_OVERHEAD > self.max_payload_bytes:
                    raise RequestError(ErrorCode.OVER_BUDGET, f"request needs {p.wire_bytes} decoded bytes; "
                                       f"max_payload_bytes is {self.max_payload_bytes}", "prompt")
            except RequestError as e:
                p.future.set_result(self._failed(p, e.info()))
                continue
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
        results: list[Result] = await asyncio.gather(*(p.future for p in pend))
        if bar is not None:
            bar.close()
        t1 = time.perf_counter()
        for r in results:
            r.timings["client_s"] = t1 - t0
            if self._tokenizer is not None and r.error is None:
                r.text = self._tokenizer.decode(r.output_token_ids)
        return [r.to_dict() for r in results]

    def _failed(self, p: Pending, error: ErrorInfo) -> Result:
        return Result(p.request.id, prompt_tokens=len(p.request.prompt_token_ids), shard=p.shard, error=error)

    async def _route(self, batch: list[Pending]) -> None:
        self.counters["route_calls"] += 1
        t0 = time.perf_counter()
        # with every shard avoided, route as usual: the answer says which shard the requests cannot reach
        avoid = sorted(self.shards.avoid) if len(self.shards.avoid) < len(self.actors) else []
        try:
            shards = await self._route_call([RouteItem(p.chain, p.est_work, p.request.sampling.max_tokens)
                                             for p in batch], avoid)
        except Exception as e:  # the router is down: every request of the batch gets the error
            for p in batch:
                p.future.set_result(self._failed(p, ErrorInfo(ErrorCode.ROUTER_ERROR, f"{type(e).__name__}: {e}")))
            return
        assert len(shards) == len(batch), "the router answers every request"
        self.counters["route_s"] += time.perf_counter() - t0
        released = []
        for p, s in zip(batch, shards, strict=True):
            p.shard = s
            why = self.shards.avoid.get(s)
            if why is None:
                self.batchers[s].add(p)
            else:  # no shard is left to serve it
                p.future.set_result(self._failed(p, why))
                released.append(Completion(s, p.est_work, p.request.sampling.max_tokens, 0, 0))
        if released:
            self.router.complete.remote(released)
        if self.flush_formed:
            for s in set(shards) - set(self.shards.avoid):
                self.batchers[s].flush("formed")

    async def _route_call(self, items: list[RouteItem], avoid: list[int]) -> list[int]:
        """One routing call, made again when it was lost with a restarting router."""
        deadline = time.monotonic() + self.restart_timeout_s
        for attempt in range(1, ROUTE_ATTEMPTS):
            try:
                return await self.router.route.remote(items, avoid)
            except RayActorError:
                if time.monotonic() >= deadline:
                    raise
                self.counters["route_retries"] += 1
                await asyncio.sleep(0.1 * attempt)
        return await self.router.route.remote(items, avoid)

    async def _send(self, shard: int, batch: list[Pending]) -> None:
        try:
            await self._send_batch(shard, batch)
        except Exception as e:  # a bug or an unreadable result must not leave callers waiting forever
            log.exception("shard %d: batch of %d failed", shard, len(batch))
            for p in batch:
                if not p.future.done():
                    p.future.set_result(self._failed(p, ErrorInfo(ErrorCode.CLIENT_ERROR, f"{type(e).__name__}: {e}")))

    async def _send_batch(self, shard: int, batch: list[Pending]) -> None:
        self.counters["batches"] += 1
        t0 = time.perf_counter()
        payload = encode_requests([p.request for p in batch], self.model_revision, self.zstd_level)
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
            await self._shard_lost(shard, batch, e)
            return
        t2 = time.perf_counter()
        if len(results) != len(batch):  # the actor could not read the batch: one record for all
            assert len(results) == 1 and results[0].id is None, "one result per request or one batch error"
            results = [dataclasses.replace(results[0], id=p.request.id, timings=dict(results[0].timings))
                       for p in batch]
        completions, reroute = [], []
        for p, r in zip(batch, results, strict=True):
            assert r.id in (p.request.id, None), "results come back in input order"
            err, max_tokens = r.error, p.request.sampling.max_tokens
            if err is not None and err.code.retryable and p.attempts < self.max_retries:
                if err.code is ErrorCode.OVERLOADED:  # the same shard, once its queue has room
                    self._retry(p, err.retry_after_s or 0.0)
                else:  # draining: another shard serves it
                    reroute.append(p)
                    completions.append(Completion(shard, p.est_work, max_tokens, 0, 0))
                    self.shards.avoid_shard(shard, err)
                continue
            r.id = p.request.id
            r.timings.update(encode_s=t1 - t0, roundtrip_s=t2 - t1, attempts=p.attempts + 1, done_at=t2)
            ok = err is None
            completions.append(Completion(shard, p.est_work, max_tokens, r.prompt_tokens if ok else 0,
                                          r.cached_tokens if ok else 0))
            if not p.future.done():
                p.future.set_result(r)
        if completions:
            self.router.complete.remote(completions)
        if reroute:
            await self._route_again(reroute)

    async def _shard_lost(self, shard: int, batch: list[Pending], e: Exception) -> None:
        """The shard died with the batch in flight: wait for its restart and route the batch again (its
        engine is cold and the router dropped its prefixes); when it does not come back, the other shards
        serve it."""
        log.warning("shard %d failed with %d requests in flight (%s); waiting for its restart",
                    shard, len(batch), type(e).__name__)
        restarted = await self.shards.await_restart(shard)
        if not restarted:
            self.shards.avoid_shard(shard, ErrorInfo(ErrorCode.SHARD_UNAVAILABLE, f"shard {shard} died and did "
                                                     f"not come back within {self.restart_timeout_s}s: {e}"))
        again = []
        for p in batch:
            if p.attempts < self.max_retries:
                again.append(p)
            elif restarted:  # a request that keeps killing shards stops here
                p.future.set_result(self._failed(p, ErrorInfo(ErrorCode.SHARD_DIED, f"shard {shard} died while "
                                                              f"serving this request, {p.attempts + 1} times: {e}")))
            else:
                p.future.set_result(self._failed(p, self.shards.avoid[shard]))
        await self._route_again(again)

    async def _route_again(self, ps: list[Pending]) -> None:
        for p in ps:
            p.attempts += 1
        self.counters["retries"] += len(ps)
        if ps:
            await self._route(ps)

    def _retry(self, p: Pending, delay_s: float) -> None:
        p.attempts += 1
        self.counters["retries"] += 1
        asyncio.get_running_loop().call_later(delay_s, self.batchers[p.shard].add, p)

    def _tokens(self, prompt) -> np.ndarray:
        """The prompt as uint32 token ids; RequestError (bad_prompt) when it cannot be one."""
        if isinstance(prompt, str):
            return np.asarray(self._tokenize(prompt), dtype=np.uint32)
        arr = prompt if isinstance(prompt, np.ndarray) else np.asarray(prompt)
        if arr.ndim != 1 or arr.size and arr.dtype.kind not in "iu":
            raise RequestError(ErrorCode.BAD_PROMPT, "prompt must be text or a flat sequence of token ids; "
                                                     f"got dtype {arr.dtype}, shape {arr.shape}", "prompt")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
            raise RequestError(ErrorCode.BAD_PROMPT, "token ids must be in [0, 2**32); got min "
                                                     f"{int(arr.min())}, max {int(arr.max())}", "prompt")
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


def make_client(cfg: ServiceConfig | None, router: ray.actor.ActorHandle, actors: dict,
                service: Service | None = None, **overrides) -> Client:
    """A client for the router and shards given, with cfg's client section (defaults without cfg) and
    `overrides` of its fields; the shards' health gives the model revision and limits. With `service`,
    closing the client stops that service."""
    health = ray.get([a.health.remote() for a in actors.values()])
    revisions = {h["model_revision"] for h in health}
    if len(revisions) != 1:
        raise RuntimeError(f"shards serve different model revisions: {sorted(revisions)}")
    config = dataclasses.replace(cfg.client if cfg is not None else ClientConfig(), **overrides)
    zstd_level = cfg.shard.zstd_level if cfg is not None else DEFAULT_ZSTD_LEVEL
    return Client(router, actors, revisions.pop(), config, zstd_level, model_dir=health[0]["model"], service=service)


def start_local(cfg: ServiceConfig, **client_kwargs) -> Client:
    """Start a service and return a Client that stops it on close()."""
    svc = start_service(cfg)
    return make_client(cfg, svc.router, svc.actors, service=svc, **client_kwargs)
