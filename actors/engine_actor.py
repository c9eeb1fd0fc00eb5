"""The engine actor: one per GPU (or CPU shard), holding one AsyncEngine for its whole life.

Requests come one way: the stream server that `stream_endpoint` names (a TCP socket: actors/stream_server.py), one
request per stream (its tokens as they are sampled) or a batch (each result as it finishes). It runs in the default
concurrency group (its own event loop); health,
stats, abort, drain and shutdown run in the "control" group, on another loop, so a saturated admission loop
never starves them; `live` runs a no-op on the serving loop from there (actors/liveness.py), so a wedged serving
loop reports unhealthy and the supervisor restarts the shard. Requests are aborted on the sender's word or when
its connection ends (actors/inflight.py). Ray creates the class with `ray.remote(EngineActor).options(...)` in
flame_llm.serving.service.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

import ray

from actors.admission import Admission, Overloaded, request_cost
from actors.as_finished import as_finished
from actors.host import EngineHost
from actors.inflight import DuplicateRequestId, Inflight
from actors.liveness import LIVE_TIMEOUT_S, Liveness, probe
from actors.metrics import ShardMetrics
from actors.pinning import ShardPlacement
from actors.shard_options import ShardOptions
from actors.stream_server import StreamServer, stream_host
from flame_llm.engine.coalesce import coalesced
from flame_llm.protocol.errors import ErrorCode, ErrorInfo, RequestError, WireError
from flame_llm.protocol.kv_events import KvEventBatch, KvEventLog
from flame_llm.protocol.stream_frames import StreamEndpoint
from flame_llm.protocol.types import EngineLimits, Request, Result, ShardHealth
from flame_llm.protocol.wire import decode_requests, decoded_size, encode_results

log = logging.getLogger(__name__)

CONTROL_GROUP = "control"
CONCURRENCY_GROUPS = {CONTROL_GROUP: 4}


class EngineActor:
    def __init__(self, placement: ShardPlacement, model: str, engine_kwargs: dict, options: ShardOptions) -> None:
        self.shard, self.name, self.gpu_uuid = placement.shard, placement.name, placement.gpu_uuid
        self.host = EngineHost.start(model, engine_kwargs, placement.gpu_uuid, placement.name, options.torch_threads)
        self.engine, self.model, self.device = self.host.engine, self.host.model, self.host.device
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.restarted = ctx.was_current_actor_reconstructed
        self.incarnation = uuid.uuid4().hex  # lets the client tell a restarted actor from the old one
        mc = self.engine.config.model_config
        self.model_revision = mc.model_revision
        self.limits = EngineLimits.of(mc.hf_config.vocab_size, mc.max_model_len, options.max_payload_bytes)
        self.zstd_level = options.zstd_level
        self.admission = Admission(options.max_inflight_tokens, options.max_inflight_requests,
                                   options.max_queued_requests)
        self.result_window_s = options.result_window_ms / 1000.0
        self.draining = False
        self.metrics = ShardMetrics()
        self.inflight = Inflight()
        self.stream_server: StreamServer | None = None  # the socket transport's, once asked for
        self.stream_limits = options.stream_limits()
        self.serve_loop: asyncio.AbstractEventLoop | None = None  # the default group's loop, once a call ran there
        self._engine_ids = 0  # the engine's request ids are unique per actor (owners may share ids)
        log.info("shard %s on %s (node %s)%s", self.name, self.device, self.node_id,
                 " (restarted)" if self.restarted else "")

    def _result(self, request_id: str | None, **fields) -> Result:
        return Result(request_id, shard=self.shard, device=self.device, node=self.node_id, **fields)

    def _decode(self, payload: bytes) -> list[Request | RequestError] | Result:
        """The batch's requests, or the one result that says why the payload is unusable."""
        self.metrics.counters["batches"] += 1
        try:
            batch = decode_requests(payload, self.limits, expected_revision=self.model_revision)
            raw = decoded_size(payload)  # a readable frame: its header says the decoded size
        except WireError as e:
            self.metrics.counters["bad_batches"] += 1
            return self._result(None, error=ErrorInfo(e.code, str(e)))
        self.metrics.batch(len(payload), raw, len(batch.items))
        return batch.items

    def _encode(self, results: list[Result]) -> bytes:
        t0 = time.perf_counter()
        out = encode_results(results, self.zstd_level)
        self.metrics.counters["encode_s"] += time.perf_counter() - t0
        self.metrics.counters["result_wire_bytes"] += len(out)
        return out

    async def stream_endpoint(self, client_node: str | None = None) -> StreamEndpoint:
        """Where this incarnation's stream server listens for a client on node `client_node` (started on the first
        call, on the serving loop): the socket transport of streams (actors/stream_server.py), and the
        token a connection presents. A client on this node (or, unnamed, any client of a one-node cluster) gets
        the loopback address; the node's address is listened on only once a client on another node asks."""
        self.serve_loop = asyncio.get_running_loop()
        if self.stream_server is None:
            self.stream_server = StreamServer(self.stream_items, self.limits.max_payload_bytes, self.name,
                                              self.incarnation, self.stream_limits, self.inflight.abort)
        return await self.stream_server.start(await stream_host(client_node, self.node_id, self.name))

    async def stream_items(self, payload: bytes, caller: str | None, client: str | None, owner: str,
                           batch: bool = False):
        """The items of one stream (the stream server's): lists of new token ids as the engine samples them, then
        the result payload (its timings add arrived_at and first_chunk_at, time.time() when the payload arrived and
        the first chunk left). Aborting the request (an ABORT frame) or the reader leaving (its connection's end) ends
        it in the engine. `owner`: the sender's identity here (its stream connection), which its request id is
        unique within; (`caller`, the sender's Ray job, `client`) its turn in admission. `batch`: the payload is a
        batch, each request's result sent as it finishes (_batch_items)."""
        arrived_at = time.time()  # the hop split (bench/service/hops.py): one host clock with the client's sent_at
        t0 = time.perf_counter()
        items = self._decode(payload)
        if batch and not isinstance(items, Result):
            async for out in self._batch_items(items, t0, caller, client, owner):
                yield out
            return
        if not isinstance(items, Result) and len(items) != 1:
            items = self._result(None, error=ErrorInfo(ErrorCode.BAD_REQUEST, "a stream payload holds exactly one "
                                                       f"request; got {len(items)}"))
        if isinstance(items, Result):
            yield self._encode([items])
            return
        self.metrics.counters["streams"] += 1
        chunks: asyncio.Queue = asyncio.Queue()
        task = asyncio.get_running_loop().create_task(self._serve(items[0], time.perf_counter(), caller, owner,
                                                                  client, chunks.put_nowait))
        task.add_done_callback(lambda _: chunks.put_nowait(None))
        first_chunk_at = None
        try:
            async for chunk in coalesced(chunks):
                if first_chunk_at is None:
                    first_chunk_at = time.time()
                yield chunk
            res = task.result()
            res.timings["arrived_at"] = arrived_at
            if first_chunk_at is not None:
                res.timings["first_chunk_at"] = first_chunk_at
            yield self._encode([res])
        finally:
            if not task.done():  # its reader left (a cancel, a closed connection): an abort, counted
                self.inflight.abort([items[0].id], owner)

    async def _batch_items(self, items: list[Request | RequestError], t0: float, caller: str | None,
                           client: str | None, owner: str):
        """A batch's result payloads, each request's result as it finishes: every request gets exactly one result,
        in finishing order (match them by id); an unreadable batch is one result with id None. Results finishing
        within result_window_ms of a payload's first travel with it (a payload leaves at once when none of the
        batch's other requests is still running). Closed early (its reader left): what still runs is aborted."""
        t1 = time.perf_counter()
        self.metrics.counters["decode_s"] += t1 - t0
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._serve(item, t1, caller, owner, client)) for item in items]
        try:
            async for results in as_finished(tasks, self.result_window_s):
                for r in results:
                    r.timings["decode_s"] = t1 - t0
                yield self._encode(results)
        finally:
            left = [it.id for it, t in zip(items, tasks, strict=True) if not t.done() and isinstance(it, Request)]
            if left:  # its reader left (a cancel, a closed connection): aborts, counted
                self.inflight.abort(left, owner)

    async def _serve(self, item: Request | RequestError, t_start: float, caller: str | None, owner: str,
                     client: str | None, emit=None) -> Result:
        self.serve_loop = asyncio.get_running_loop()
        if isinstance(item, RequestError):
            self.metrics.counters["errors"] += 1
            return self._result(item.id, error=item.info())
        res = self._result(item.id, prompt_tokens=len(item.prompt_token_ids))
        if self.draining:
            self.metrics.counters["errors"] += 1
            res.error = ErrorInfo(ErrorCode.DRAINING, f"shard {self.name} is draining")
            return res
        try:
            if not self.inflight.add(item.id, owner):  # aborted on its way here
                res.finish_reason = "abort"
                return res
        except DuplicateRequestId as e:  # refused before it registered: the one in flight is untouched
            self.metrics.counters["errors"] += 1
            res.error = ErrorInfo(ErrorCode.DUPLICATE_ID, str(e))
            return res
        try:  # each (sender, user) takes its own turn in fair admission (Request.user: the door's users)
            return await self._admit_and_run(item, res, t_start, emit, (caller, client, item.user))
        except asyncio.CancelledError:
            if not self.inflight.was_aborted(item.id, owner):
                raise
            asyncio.current_task().uncancel()
            self.inflight.forget(item.id, owner)
            res.finish_reason, res.timings = "abort", {"total_s": time.perf_counter() - t_start}
            return res
        finally:
            self.inflight.remove(item.id, owner)

    async def _admit_and_run(self, item: Request, res: Result, t_start: float, emit, sender: tuple) -> Result:
        sp = item.sampling
        cost = request_cost(len(item.prompt_token_ids), sp.max_tokens, self.limits.max_model_len)
        try:
            await self.admission.acquire(cost, sender)
        except Overloaded as e:
            self.metrics.counters["errors"] += 1
            res.error = ErrorInfo(ErrorCode.OVERLOADED, f"shard {self.name}: {e}", e.retry_after_s)
            res.timings = {"queue_s": time.perf_counter() - t_start}
            return res
        t_admit = time.perf_counter()
        self._engine_ids += 1
        engine_id = f"{item.id}#{self._engine_ids}"  # two owners' equal ids are two engine requests
        try:
            if emit is None:
                out = await self.engine.generate(item.prompt_token_ids, sp, request_id=engine_id, checked=True)
            else:
                async for x in self.engine.stream_chunks(item.prompt_token_ids, sp, engine_id, checked=True):
                    if isinstance(x, list):
                        emit(x)
                    else:
                        out = x
        except Exception as e:  # one request's failure must not fail its batch
            self.metrics.counters["errors"] += 1
            if self.engine.failed:
                # the step loop is dead and every later request would fail: crash so that Ray
                # restarts this actor on its device; the client resubmits the unanswered batch
                log.critical("shard %s: engine step loop failed (%r); exiting for a restart", self.name,
                             self.engine.error)
                os._exit(1)
            if isinstance(e, ValueError):  # the engine's own request checks (KV pool size), a request failed alone
                code = ErrorCode.INVALID_REQUEST
            else:
                code = ErrorCode.ENGINE_ERROR
                log.exception("shard %s: request %s failed", self.name, item.id)
            res.error = ErrorInfo(code, f"{type(e).__name__}: {e}")
            res.timings = {"queue_s": t_admit - t_start}
            return res
        finally:
            self.admission.release(cost, sender)
        t_done = time.perf_counter()
        timings = {"queue_s": t_admit - t_start, "engine_s": t_done - t_admit, "total_s": t_done - t_start}
        res = Result.from_output(out, item.prompt_token_ids, timings, shard=self.shard, device=self.device,
                                 node=self.node_id)
        res.id = item.id
        self.metrics.served(res)
        return res

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def live(self, timeout_s: float = LIVE_TIMEOUT_S) -> Liveness:
        """Whether the loop that serves requests and the stream port runs (a no-op within timeout_s), and the
        process's file descriptors (actors/liveness.py). Unlike `health`, a wedged serving loop fails it."""
        return await probe(self.serve_loop, timeout_s)

    async def debug_block_loop(self, seconds: float) -> None:
        """Fault injection (tests, drills): the serving loop blocks for `seconds`, as a wedged one does."""
        time.sleep(seconds)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def health(self) -> ShardHealth:
        """Placement, identity and state, and the limits requests are checked against."""
        return ShardHealth(self.shard, self.name, self.device, self.node_id, os.getpid(), self.model,
                           self.model_revision, self.incarnation, self.restarted, self.limits,
                           # requests one caller has there without a rejection: its flow-control credit
                           self.admission.max_requests + self.admission.max_queued, self.draining,
                           self.engine.failed, tuple(self.engine.config.model_config.eos_token_ids),
                           self.engine.config.model_config.tokenizer)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def debug_break_engine(self) -> None:
        """Fault injection (tests, drills): flame_llm/engine/faults.py break_engine."""
        self.engine.break_engine(self.name)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def debug_slow_engine(self, pause_s: float) -> None:
        """Fault injection (tests, drills): flame_llm/engine/faults.py slow_engine."""
        self.engine.slow_engine(pause_s)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def stats(self) -> dict:
        sock = self.stream_server.counters if self.stream_server is not None else {}
        return {**self.health().to_dict(), **self.metrics.to_dict(), **self.inflight.counters, **self.admission.stats(),
                **sock, "load_s": self.host.load_s, "frozen_objects": self.host.frozen_objects,
                "engine": self.engine.stats()}

    @ray.method(concurrency_group=CONTROL_GROUP)
    def kv_events(self, epoch: int, after_seq: int, with_load: bool = False) -> list[KvEventBatch]:
        """The prefix-cache event batches after a reader's cursor, or one snapshot (flame_llm/protocol/kv_events.py);
        with_load (router.load_view 'engines'): the last one carries this shard's load, its waiting and running
        requests' (ShardLoad). ValueError unless the engine runs with enable_kv_events."""
        if getattr(self, "kv_log", None) is None:
            self.kv_log = KvEventLog(self.shard, self.engine.block_manager, sequences=self.engine.sequences)
        return self.kv_log.read(epoch, after_seq, with_load)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def drain(self, timeout_s: float = 60.0) -> bool:
        """Refuse new requests; wait until admitted and queued ones finish. True when drained."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.admission.requests or self.admission.queued:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def shutdown(self, timeout_s: float = 60.0) -> bool:
        drained = await self.drain(timeout_s)
        self.host.stop()
        return drained
