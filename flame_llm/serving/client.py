"""The Python client: hands prompts to its Dispatcher (dispatch.py: checks, routing, one channel per shard:
batches, credit, retries) and returns flame_llm.protocol.types.Result objects: `generate` in input order,
`as_completed` as they finish; streams one request's tokens. A result whose error is retryable does not reach the
caller while the retry policy (retry.py) says to send it again.

All client work runs on one event loop, so `generate` (sync) and `agenerate` (from any asyncio loop) share the
shard channels and concurrent callers' requests coalesce into batches: the client's own loop thread, or the caller's
loop given as `loop=` (an asyncio server such as the front door: its calls and streams then run on that loop with
no hand-off between threads; `generate` must then be called from another thread, `aclose` from that loop)."""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import ray

from flame_llm.protocol.checks import fits_utf8
from flame_llm.protocol.errors import ErrorCode, ErrorInfo
from flame_llm.protocol.types import DEFAULT_ZSTD_LEVEL, MAX_USER_BYTES, Result, ShardHealth
from flame_llm.sampling_params import SamplingParams, brief
from flame_llm.serving.client_config import ClientConfig
from flame_llm.serving.dispatch import Dispatcher
from flame_llm.serving.pending import ClientCounters, StreamChunk, StreamError
from flame_llm.serving.ray_attach import attach, find_service, resolve_namespace

if TYPE_CHECKING:  # the service side imports the engine; the client needs only its attributes
    from flame_llm.serving.service import Service
    from flame_llm.serving.service_config import ServiceConfig


def check_user(user: str) -> None:
    """A request's user (Request.user): a str of at most MAX_USER_BYTES UTF-8 bytes; ValueError naming it."""
    if not fits_utf8(user, MAX_USER_BYTES):
        raise ValueError(f"user must be a string of at most {MAX_USER_BYTES} UTF-8 bytes; got {brief(user)}")


class Client:
    def __init__(self, router, actors: dict[int, ray.actor.ActorHandle], health: list[ShardHealth],
                 config: ClientConfig | None = None, zstd_level: int = DEFAULT_ZSTD_LEVEL, service=None,
                 namespace: str | None = None, loop: asyncio.AbstractEventLoop | None = None):
        """health: each shard's (make_client asks them): one model revision, the limits, the tokenizer."""
        assert actors and len(health) == len(actors), "a service has at least one shard, each with its health"
        self.config, self.service, self.client_id = config or ClientConfig(), service, uuid.uuid4().hex[:8]
        h = health[0]  # one model revision: one tokenizer (the shards' `tokenizer` field)
        self.model_revision, self.model_dir, self.tokenizer_field = h.model_revision, h.model, h.tokenizer
        self.namespace = namespace or ray.get_runtime_context().namespace
        self._calls: set[asyncio.Task] = set()  # generate and stream calls running on the client loop
        d = self.dispatch = Dispatcher(router, dict(actors), health, self.config, zstd_level, self.namespace,
                                       self.client_id)
        # what every shard accepts; router: RouterReplicas
        self.limits, self.requests, self.router, self.actors = d.limits, d.requests, d.router, d.actors
        self._thread = None
        self._loop = loop
        if loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="flame-client", daemon=True)
            self._thread.start()
        # a connection per shard from now on: a shard's death is seen at once
        self._loop.call_soon_threadsafe(self.dispatch.keep_connected)

    @classmethod
    def connect(cls, namespace: str | None = None, address: str | None = "auto", **kwargs) -> Client:
        """A client of the service running in `namespace` of the Ray cluster at `address` (namespace None: the
        default one, or the one namespace that runs a service)."""
        attach(namespace, address)
        namespace = resolve_namespace(namespace)
        router, actors = find_service(namespace)
        return make_client(None, router, actors, namespace=namespace, **kwargs)

    @classmethod
    def for_service(cls, svc: Service, **kwargs) -> Client:
        """A client of a service this process started (closing it leaves the service running)."""
        return make_client(svc.cfg, svc.routers, svc.actors, namespace=svc.cfg.ray.namespace, **kwargs)

    @property
    def counters(self) -> ClientCounters:
        """This client's running totals (its dispatcher's)."""
        return self.dispatch.counters

    def generate(self, prompts: list, sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = False, overload_deadline_s: float | None = None) -> list[Result]:
        """Each prompt's Result, in input order; use_tqdm: a progress bar advanced per result as it lands.
        overload_deadline_s: how long a request may be retried on overloaded shards before `overloaded` is its
        result (None: ClientConfig.overload_deadline_s)."""
        self._not_on_loop("generate")
        call = self.dispatch.generate(prompts, sampling_params, use_tqdm, overload_deadline_s)
        fut = asyncio.run_coroutine_threadsafe(self._call(call), self._loop)
        try:
            return fut.result()
        except BaseException:  # interrupted (Ctrl-C): the shards abort what this call sent
            fut.cancel()
            raise

    async def agenerate(self, prompts: list, sampling_params: SamplingParams | list[SamplingParams],
                        overload_deadline_s: float | None = None, user: str = "") -> list[Result]:
        """As generate, awaited from any asyncio loop; cancelling it aborts its requests on the shards. `user`:
        whose turn its requests take while they wait for a shard's credit and in its fair admission (stream_chunks)."""
        check_user(user)
        call = self.dispatch.generate(prompts, sampling_params, False, overload_deadline_s, user=user)
        if self._on_loop():
            return await self._call(call)
        fut = asyncio.run_coroutine_threadsafe(self._call(call), self._loop)
        return await asyncio.wrap_future(fut)

    def as_completed(self, prompts: list, sampling_params: SamplingParams | list[SamplingParams],
                     use_tqdm: bool = False, overload_deadline_s: float | None = None
                     ) -> Iterator[tuple[int, Result]]:
        """`for index, result in client.as_completed(prompts, sp)`: each prompt's Result as it lands (index: the
        prompt's position). Leaving the loop early aborts the requests not yet answered."""
        self._not_on_loop("as_completed")
        landed: queue.SimpleQueue = queue.SimpleQueue()
        call = self.dispatch.generate(prompts, sampling_params, use_tqdm, overload_deadline_s,
                                      lambda i, r: landed.put((i, r)))
        fut = asyncio.run_coroutine_threadsafe(self._call(call), self._loop)
        fut.add_done_callback(lambda _: landed.put(None))
        try:
            while (item := landed.get()) is not None:
                yield item
            fut.result()  # raises what the call raised (bad arguments)
        finally:
            fut.cancel()

    async def stream_chunks(self, prompt, sampling_params: SamplingParams, user: str = ""):
        """One request's output as it is sampled: StreamChunk(token_ids) as the shard sends them, the last one
        with `result` (its Result, as generate returns it; an error is in its `error`). Routed, encoded and
        checked like generate's requests and retried likewise; a shard's death after its first token sends the
        rest on as a continuation (flame_llm/serving/retry.py). Leaving the loop early
        (break, cancel, close) aborts the request on its shard. `user`: whose turn it takes while it waits for
        a shard's credit and in its fair admission (users take turns; the front door passes its end users)."""
        check_user(user)
        caller_loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()

        def push(chunk: StreamChunk) -> None:
            caller_loop.call_soon_threadsafe(chunks.put_nowait, chunk)

        if caller_loop is self._loop:  # the client runs on the caller's loop: no hand-off between threads
            push = chunks.put_nowait
            fut = caller_loop.create_task(self._call(self.dispatch.stream(prompt, sampling_params, push, user)))
        else:
            fut = asyncio.run_coroutine_threadsafe(
                self._call(self.dispatch.stream(prompt, sampling_params, push, user)), self._loop)
        fut.add_done_callback(lambda f: f.cancelled() or (e := f.exception()) is None or push(
            StreamChunk([], Result(None, error=ErrorInfo(ErrorCode.CLIENT_ERROR, f"{type(e).__name__}: {e}")))))
        try:
            while True:
                chunk = await chunks.get()
                yield chunk
                if chunk.result is not None:
                    return
        finally:
            fut.cancel()

    async def stream(self, prompt, sampling_params: SamplingParams, user: str = ""):
        """`async for token_id in client.stream(prompt, sp)`: the output token ids as the shard samples them.
        A failed request raises StreamError (its Result in `.result`) once the tokens it had are out."""
        async for chunk in self.stream_chunks(prompt, sampling_params, user):
            for t in chunk.token_ids:
                yield t
            if chunk.result is not None and chunk.result.error is not None:
                raise StreamError(chunk.result)

    def close(self) -> None:
        """Abort this client's unfinished requests on the shards and stop its loop (and its service, if it
        started one). A client on the caller's loop: call it from another thread, or `await aclose()`."""
        self._not_on_loop("close")
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._abandon_all(), self._loop).result(timeout=10)
            if self._thread is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=5)
        self._stop_service()

    async def aclose(self) -> None:
        """close(), awaited on the loop the client runs on (given as `loop=`)."""
        if not self._on_loop():
            await asyncio.to_thread(self.close)
            return
        await self._abandon_all()
        if self.service is not None:
            await asyncio.to_thread(self._stop_service)

    def _stop_service(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _not_on_loop(self, what: str) -> None:
        if self._thread is None and self._on_loop():
            raise RuntimeError(f"Client.{what} blocks: on the loop the client runs on, use agenerate, stream or "
                               "aclose")

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- on the client loop ---

    async def _call(self, coro):
        """Run a generate or stream call as a task the client can abandon on close."""
        task = asyncio.current_task()
        self._calls.add(task)
        try:
            return await coro
        finally:
            self._calls.discard(task)

    async def _abandon_all(self) -> None:
        tasks = list(self._calls)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.dispatch.close()


def make_client(cfg: ServiceConfig | None, router, actors: dict,
                service: Service | None = None, namespace: str | None = None,
                loop: asyncio.AbstractEventLoop | None = None, **overrides) -> Client:
    """A client for the router (a handle, the replicas' handles, or a RouterReplicas) and shards given, with cfg's
    client section (defaults without cfg) and `overrides` of its fields; the shards' health gives the model revision
    and limits. With `service`, closing the client stops that service. loop: run it on that loop (Client's `loop`)."""
    config = dataclasses.replace(cfg.client if cfg is not None else ClientConfig(), **overrides)  # names a bad one
    health = ray.get([a.health.remote() for a in actors.values()])
    revisions = {h.model_revision for h in health}
    if len(revisions) != 1:
        raise RuntimeError(f"shards serve different model revisions: {sorted(revisions)}")
    zstd_level = cfg.shard.zstd_level if cfg is not None else DEFAULT_ZSTD_LEVEL
    namespace = namespace or (cfg.ray.namespace if cfg is not None else None)
    return Client(router, actors, health, config, zstd_level, service=service, namespace=namespace, loop=loop)


def start_local(cfg: ServiceConfig, **client_kwargs) -> Client:
    """Start a service and return a Client that stops it on close()."""
    from flame_llm.serving.service import start_service

    svc = start_service(cfg)
    return make_client(cfg, svc.routers, svc.actors, service=svc, namespace=cfg.ray.namespace, **client_kwargs)
