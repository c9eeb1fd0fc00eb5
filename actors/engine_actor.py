"""The engine actor: one per GPU (or CPU shard), holding one AsyncEngine for its whole life.

`submit` runs in the default concurrency group (its own event loop); health, stats, drain and
shutdown run in the "control" group, on another loop, so a saturated admission loop never starves
them. Ray creates the class with `ray.remote(EngineActor).options(...)` in flame_llm.serving.service.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
import uuid

import ray

from actors.admission import Admission, Overloaded
from actors.pinning import pin_visible_device, verify_device
from flame_llm.protocol.types import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    EngineLimits,
    ErrorCode,
    ErrorInfo,
    Request,
    RequestError,
    Result,
    WireError,
    prompt_digest,
)
from flame_llm.protocol.wire import decode_requests, encode_results

log = logging.getLogger(__name__)

CONTROL_GROUP = "control"
CONCURRENCY_GROUPS = {CONTROL_GROUP: 4}


def resolve_model(model: str) -> str:
    if model == "tiny":
        from flame_llm.models.tiny import ensure_tiny_default
        return ensure_tiny_default()
    return model


class EngineActor:
    def __init__(self, shard: int, name: str, gpu_uuid: str | None, model: str, engine_kwargs: dict,
                 max_inflight_tokens: int, max_inflight_requests: int, max_queued_requests: int,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, zstd_level: int = 1, torch_threads: int = 1):
        pin_visible_device(gpu_uuid)  # before anything touches CUDA
        import torch

        from flame_llm import AsyncEngine

        self.shard, self.name, self.gpu_uuid = shard, name, gpu_uuid
        self.device = gpu_uuid or name  # what results and health report: the GPU UUID, or "cpu-k"
        kwargs = dict(engine_kwargs)
        if gpu_uuid is not None:
            verify_device(gpu_uuid, name)
            kwargs.setdefault("device", "cuda")
        else:
            torch.set_num_threads(torch_threads)
            kwargs.setdefault("device", "cpu")
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.restarted = ctx.was_current_actor_reconstructed
        self.incarnation = uuid.uuid4().hex  # lets the client tell a restarted actor from the old one
        t0 = time.perf_counter()
        self.model = resolve_model(model)
        self.engine = AsyncEngine.from_args(self.model, **kwargs)
        cfg = self.engine.config
        self.model_revision = cfg.model_config.model_revision
        self.limits = EngineLimits.of(cfg.model_config.hf_config.vocab_size, cfg.model_config.max_model_len,
                                      max_payload_bytes)
        self.load_s = time.perf_counter() - t0
        self.zstd_level = zstd_level
        self.admission = Admission(max_inflight_tokens, max_inflight_requests, max_queued_requests)
        self.draining = False
        self.counters = {"batches": 0, "requests": 0, "bad_batches": 0, "errors": 0, "cached_tokens": 0,
                         "prompt_tokens": 0, "output_tokens": 0, "decode_s": 0.0, "encode_s": 0.0}
        # Everything allocated so far lives as long as the actor: keep the collector off it.
        gc.collect()
        gc.freeze()
        self.frozen_objects = gc.get_freeze_count()
        log.info("shard %s on %s (node %s): model loaded in %.1fs, %d objects frozen%s", name, self.device,
                 self.node_id, self.load_s, self.frozen_objects, " (restarted)" if self.restarted else "")

    def _result(self, request_id: str | None, **fields) -> Result:
        return Result(request_id, shard=self.shard, device=self.device, node=self.node_id, **fields)

    async def submit(self, payload: bytes) -> bytes:
        """A request batch payload in, a result payload out (input order). Never raises for bad input."""
        t0 = time.perf_counter()
        self.counters["batches"] += 1
        try:
            batch = decode_requests(payload, self.limits, expected_revision=self.model_revision)
        except WireError as e:
            self.counters["bad_batches"] += 1
            return encode_results([self._result(None, error=ErrorInfo(e.code, str(e)))], self.zstd_level)
        t1 = time.perf_counter()
        self.counters["decode_s"] += t1 - t0
        results = await asyncio.gather(*(self._serve(item, t1) for item in batch.items))
        for r in results:
            r.timings["decode_s"] = t1 - t0
        t2 = time.perf_counter()
        out = encode_results(results, self.zstd_level)
        self.counters["encode_s"] += time.perf_counter() - t2
        return out

    async def _serve(self, item: Request | RequestError, t_start: float) -> Result:
        if isinstance(item, RequestError):
            self.counters["errors"] += 1
            return self._result(item.id, error=item.info())
        res = self._result(item.id, prompt_tokens=len(item.prompt_token_ids))
        if self.draining:
            self.counters["errors"] += 1
            res.error = ErrorInfo(ErrorCode.DRAINING, f"shard {self.name} is draining")
            return res
        sp = item.sampling
        cost = len(item.prompt_token_ids) + sp.max_tokens
        try:
            await self.admission.acquire(cost)
        except Overloaded as e:
            self.counters["errors"] += 1
            res.error = ErrorInfo(ErrorCode.OVERLOADED, f"shard {self.name}: {e}", e.retry_after_s)
            res.timings = {"queue_s": time.perf_counter() - t_start}
            return res
        t_admit = time.perf_counter()
        try:
            out = await self.engine.generate(item.prompt_token_ids, sp, request_id=item.id)
        except Exception as e:  # one request's failure must not fail its batch
            self.counters["errors"] += 1
            if isinstance(e, ValueError):  # the engine's own request checks (KV pool size)
                code = ErrorCode.INVALID_REQUEST
            else:
                code = ErrorCode.ENGINE_ERROR
                log.exception("shard %s: request %s failed", self.name, item.id)
                if self.engine.failed:
                    # the step loop is dead and every later request would fail: crash so that Ray
                    # restarts this actor on its device; the client resubmits the unanswered batch
                    log.critical("shard %s: engine step loop failed (%r); exiting for a restart", self.name,
                                 self.engine.error)
                    os._exit(1)
            res.error = ErrorInfo(code, f"{type(e).__name__}: {e}")
            res.timings = {"queue_s": t_admit - t_start}
            return res
        finally:
            self.admission.release(cost)
        t_done = time.perf_counter()
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += out.num_prompt_tokens
        self.counters["cached_tokens"] += out.num_cached_tokens
        self.counters["output_tokens"] += len(out.output_token_ids)
        res.output_token_ids, res.finish_reason = out.output_token_ids, out.finish_reason
        res.prompt_tokens, res.cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
        res.prompt_digest = prompt_digest(item.prompt_token_ids)
        res.timings = {"queue_s": t_admit - t_start, "engine_s": t_done - t_admit, "total_s": t_done - t_start,
                       **{k: float(v) for k, v in out.metrics.items()
                          if k in ("ttft", "tpot") and isinstance(v, (int, float))}}
        return res

    @ray.method(concurrency_group=CONTROL_GROUP)
    def health(self) -> dict:
        """Placement, identity and state, and the limits requests are checked against (EngineLimits)."""
        return {"shard": self.shard, "device": self.device, "node": self.node_id, "name": self.name,
                "incarnation": self.incarnation, "restarted": self.restarted, "pid": os.getpid(), "model": self.model,
                "model_revision": self.model_revision, **self.limits.to_dict(), "draining": self.draining,
                "engine_failed": self.engine.failed}

    @ray.method(concurrency_group=CONTROL_GROUP)
    def debug_break_engine(self) -> None:
        """Fault injection (tests, drills): the engine's next step raises, as a real step failure would."""
        def broken(*args, **kwargs):
            raise RuntimeError(f"injected engine step failure on shard {self.name}")

        self.engine.engine.model_runner.launch = broken

    @ray.method(concurrency_group=CONTROL_GROUP)
    def stats(self) -> dict:
        return {**self.health(), **self.counters, **self.admission.stats(), "load_s": self.load_s,
                "frozen_objects": self.frozen_objects, "engine": self.engine.stats()}

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
        gc.unfreeze()
        self.engine.shutdown()
        return drained
