"""How the client's requests reach the shards: one router call per formed batch, per-shard batchers, compressed
payloads to the engine actors, and the retry rules of flame_llm.protocol.types.RETRYABLE: an overloaded
shard's request goes back to it after its retry hint; a draining shard's requests, and those of a shard that
died and did not come back, are routed to the other shards (its ShardWatch avoids that shard until its health
says it serves again); a router call lost with a restarting router is made again. Runs on the client's loop."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque

import ray
from ray.exceptions import ActorUnschedulableError, RayActorError

from flame_llm.protocol.routing_key import Completion, RouteItem
from flame_llm.protocol.types import ErrorCode, ErrorInfo, Result
from flame_llm.protocol.wire import BATCH_OVERHEAD, decode_results, decoded_size, encode_requests
from flame_llm.serving.batcher import Pending, ShardBatcher
from flame_llm.serving.service import SHARD_PREFIX
from flame_llm.serving.service_config import ClientConfig
from flame_llm.serving.shard_watch import ShardWatch

log = logging.getLogger(__name__)
ROUTE_ATTEMPTS = 3  # router calls per batch: one lost with a restarting router is made again
SHARD_LOST = (RayActorError, ActorUnschedulableError)  # the shard's actor died, or cannot be placed again
CREDIT_PARTS = 2  # a shard's credit leaves in halves: one answered half frees room while the other runs


def failed_result(p: Pending, error: ErrorInfo) -> Result:
    return Result(p.request.id, prompt_tokens=len(p.request.prompt_token_ids), shard=p.shard, error=error)


class Dispatcher:
    def __init__(self, router, actors: dict[int, ray.actor.ActorHandle], model_revision: str, config: ClientConfig,
                 zstd_level: int, health: list[dict], max_payload_bytes: int, namespace: str, counters: dict):
        self.router, self.actors, self.model_revision = router, actors, model_revision
        self.zstd_level, self.max_retries = zstd_level, config.max_retries
        self.restart_timeout_s, self.flush_formed = config.restart_timeout_s, config.flush_formed
        self.namespace, self.counters = namespace, counters
        # the shards abort this client's requests when its Ray job (this process) dies
        self.caller = ray.get_runtime_context().get_job_id()
        self.shards = ShardWatch(actors, router, health, config.restart_timeout_s, counters,
                                 lookup=self.lookup_shard)
        self.batchers = {s: ShardBatcher(s, self.send, config.max_batch_prompts, config.batch_window_ms / 1000.0,
                                         max_payload_bytes) for s in actors}
        self.max_batch_prompts, self.max_payload_bytes = config.max_batch_prompts, max_payload_bytes
        # flow control: this client keeps at most a shard's admission capacity (in flight + queued requests)
        # unanswered there, so a burst waits here instead of being rejected and retried after a hint
        self.capacity = {s: h.get("admission_capacity") if config.flow_control else None
                         for s, h in zip(actors, health, strict=True)}
        self.credit_chunk = {s: max(1, c // CREDIT_PARTS) for s, c in self.capacity.items() if c}
        self.outstanding = dict.fromkeys(actors, 0)
        # per shard, in turn for its credit: held requests, and futures of streams waiting for a unit
        self.held: dict[int, deque[Pending | asyncio.Future]] = {s: deque() for s in actors}
        self._tasks: set[asyncio.Task] = set()

    def abort_on(self, shard: int, request_ids: list[str]) -> None:
        self.counters["aborts_sent"] += len(request_ids)
        try:
            self.actors[shard].abort.remote(request_ids)
        except Exception as e:  # noqa: BLE001 - the shard is gone; so are its requests
            log.debug("abort on shard %d failed: %s", shard, e)

    def lookup_shard(self, shard: int) -> ray.actor.ActorHandle | None:
        """The shard's actor by name (a replacement placed after its node was lost has a new handle)."""
        try:
            return ray.get_actor(f"{SHARD_PREFIX}{shard}", namespace=self.namespace)
        except ValueError:
            return None

    async def route(self, batch: list[Pending]) -> None:
        self.counters["route_calls"] += 1
        t0 = time.perf_counter()
        # with every shard avoided, route as usual: the answer says which shard the requests cannot reach
        avoid = sorted(self.shards.avoid) if len(self.shards.avoid) < len(self.actors) else []
        try:
            shards = await self.route_call([RouteItem(p.chain, p.est_work, p.est_decode)
                                             for p in batch], avoid)
        except Exception as e:  # the router is down: every request of the batch gets the error
            for p in batch:
                p.future.set_result(failed_result(p, ErrorInfo(ErrorCode.ROUTER_ERROR, f"{type(e).__name__}: {e}")))
            return
        assert len(shards) == len(batch), "the router answers every request"
        self.counters["route_s"] += time.perf_counter() - t0
        released = []
        for p, s in zip(batch, shards, strict=True):
            p.shard = s
            if p.future.done():  # abandoned while its route was asked for
                released.append(p)
                continue
            why = self.shards.avoid.get(s)
            if why is None:
                self.batchers[s].add(p)
            else:  # no shard is left to serve it
                p.future.set_result(failed_result(p, why))
                released.append(p)
        for s in {p.shard for p in released}:
            self.forget(s, [p for p in released if p.shard == s])
        if self.flush_formed:
            for s in set(shards) - set(self.shards.avoid):
                self.batchers[s].flush("formed")

    async def route_call(self, items: list[RouteItem], avoid: list[int]) -> list[int]:
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

    async def send(self, shard: int, batch: list[Pending]) -> None:
        """A formed batch of the shard's batcher. With flow control, it waits in the shard's credit queue and
        leaves in parts of at most credit_chunk requests while the shard has room for them."""
        if self.capacity.get(shard) is None:
            await self._send_guarded(shard, batch)
            return
        self.held[shard].extend(batch)
        self._release_held(shard)

    def _release_held(self, shard: int) -> None:
        """Serve the shard's credit queue in order while it has room: held requests leave in parts, a waiting
        stream is granted its unit (a shard routed around now sends nothing: its held requests are routed
        again, its streams go on and meet the shard's state themselves)."""
        held, cap = self.held[shard], self.capacity[shard]
        avoided = shard in self.shards.avoid
        part, nbytes, limit = [], BATCH_OVERHEAD, min(self.credit_chunk[shard], self.max_batch_prompts)
        again, gone = [], []
        while held:
            item = held[0]
            if not avoided and cap - self.outstanding[shard] - len(part) <= 0:
                self.counters["credit_waits"] += 1
                break
            if isinstance(item, asyncio.Future):  # a stream waiting for credit
                held.popleft()
                if not item.done():
                    self.outstanding[shard] += 1
                    item.set_result(None)
                continue
            if not avoided and part and (len(part) >= limit or nbytes + item.wire_bytes > self.max_payload_bytes):
                self._send_part(shard, part)
                part, nbytes = [], BATCH_OVERHEAD
                continue
            held.popleft()
            if item.future.done():  # abandoned while it waited
                gone.append(item)
            elif avoided:
                again.append(item)
            else:
                part.append(item)
                nbytes += item.wire_bytes
        if part:
            self._send_part(shard, part)
        self.forget(shard, gone + again)
        if again:
            self._spawn(self.route_again(again))

    def _send_part(self, shard: int, part: list[Pending]) -> None:
        self.outstanding[shard] += len(part)
        self._spawn(self._send_counted(shard, part))

    async def take_credit(self, shard: int) -> bool:
        """One unit of the shard's credit for a stream, in turn with the requests held before it; False without
        flow control."""
        cap = self.capacity.get(shard)
        if cap is None:
            return False
        if self.outstanding[shard] < cap and not self.held[shard]:
            self.outstanding[shard] += 1
            return True
        fut = asyncio.get_running_loop().create_future()
        self.held[shard].append(fut)
        self.counters["credit_waits"] += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled: the unit goes back
                self.give_credit(shard)
            raise
        return True

    def forget(self, shard: int, ps: list[Pending]) -> None:
        """Routed requests that will not be answered by the shard: their estimated work leaves the router's
        count of the shard's outstanding work."""
        if ps:
            self.router.complete.remote([Completion(shard, p.est_work, p.est_decode, 0, 0)
                                         for p in ps])

    def give_credit(self, shard: int) -> None:
        self.outstanding[shard] -= 1
        self._release_held(shard)

    async def _send_counted(self, shard: int, part: list[Pending]) -> None:
        try:
            await self._send_guarded(shard, part)
        finally:
            self.outstanding[shard] -= len(part)
            self._release_held(shard)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_guarded(self, shard: int, batch: list[Pending]) -> None:
        try:
            await self._send_batch(shard, batch)
        except Exception as e:  # a bug or an unreadable result must not leave callers waiting forever
            log.exception("shard %d: batch of %d failed", shard, len(batch))
            unanswered = [p for p in batch if not p.future.done()]
            for p in unanswered:
                p.future.set_result(failed_result(p, ErrorInfo(ErrorCode.CLIENT_ERROR, f"{type(e).__name__}: {e}")))
            self.forget(shard, unanswered)

    async def _send_batch(self, shard: int, batch: list[Pending]) -> None:
        self.counters["batches"] += 1
        t0 = time.perf_counter()
        payload = encode_requests([p.request for p in batch], self.model_revision, self.zstd_level)
        t1 = time.perf_counter()
        c = self.counters
        c["encode_s"] += t1 - t0
        c["payload_wire_bytes"] += len(payload)
        c["payload_raw_bytes"] += decoded_size(payload)  # the msgpack size, from the header
        try:
            reply = await self.actors[shard].submit.remote(payload, self.caller)
            t_dec = time.perf_counter()
            results = decode_results(reply)
            c["result_decode_s"] += time.perf_counter() - t_dec
        except SHARD_LOST as e:
            await self.shard_lost(shard, batch, e)
            return
        t2 = time.perf_counter()
        if len(results) != len(batch):  # the actor could not read the batch: one record for all
            assert len(results) == 1 and results[0].id is None, "one result per request or one batch error"
            results = [dataclasses.replace(results[0], id=p.request.id, timings=dict(results[0].timings))
                       for p in batch]
        completions, reroute = [], []
        for p, r in zip(batch, results, strict=True):
            assert r.id in (p.request.id, None), "results come back in input order"
            err, decode = r.error, p.est_decode
            if p.future.done():  # abandoned by its caller (and aborted on the shard)
                completions.append(Completion(shard, p.est_work, decode, 0, 0))
                continue
            if err is not None and err.code.retryable and p.attempts < self.max_retries:
                if err.code is ErrorCode.OVERLOADED:  # the same shard, once its queue has room
                    self.retry(p, err.retry_after_s or 0.0)
                else:  # draining: another shard serves it
                    reroute.append(p)
                    completions.append(Completion(shard, p.est_work, decode, 0, 0))
                    self.shards.avoid_shard(shard, err)
                continue
            r.id = p.request.id
            r.timings.update(encode_s=t1 - t0, roundtrip_s=t2 - t1, attempts=p.attempts + 1, done_at=t2)
            ok = err is None
            completions.append(Completion(shard, p.est_work, decode, r.prompt_tokens if ok else 0,
                                          r.cached_tokens if ok else 0))
            if not p.future.done():
                p.future.set_result(r)
        if completions:
            self.router.complete.remote(completions)
        if reroute:
            await self.route_again(reroute)

    async def shard_lost(self, shard: int, batch: list[Pending], e: Exception) -> None:
        """The shard died with the batch in flight: wait for its restart and route the batch again (its
        engine is cold and the router dropped its prefixes); when it does not come back, or cannot (its node
        is gone), the other shards serve it."""
        log.warning("shard %d failed with %d requests in flight (%s); waiting for its restart",
                    shard, len(batch), type(e).__name__)
        restarted = await self.shards.await_restart(shard, e)
        if not restarted:
            self.shards.lose_shard(shard, e)
        again = []
        for p in batch:
            if p.future.done():
                continue
            if p.attempts < self.max_retries:
                again.append(p)
            elif restarted:  # a request that keeps killing shards stops here
                p.future.set_result(failed_result(p, ErrorInfo(ErrorCode.SHARD_DIED, f"shard {shard} died while "
                                                              f"serving this request, {p.attempts + 1} times: {e}")))
            else:
                p.future.set_result(failed_result(p, self.shards.avoid[shard]))
        await self.route_again(again)

    async def route_again(self, ps: list[Pending]) -> None:
        ps = [p for p in ps if not p.future.done()]
        for p in ps:
            p.attempts += 1
        self.counters["retries"] += len(ps)
        if ps:
            await self.route(ps)

    def retry(self, p: Pending, delay_s: float) -> None:
        p.attempts += 1
        self.counters["retries"] += 1
        asyncio.get_running_loop().call_later(delay_s, self._retry_now, p)

    def _retry_now(self, p: Pending) -> None:
        if p.future.done():  # abandoned during its retry delay
            self.forget(p.shard, [p])
        else:
            self.batchers[p.shard].add(p)
