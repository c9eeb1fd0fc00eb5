"""How the client's requests reach the shards: one router call per formed batch (routing.py), per-shard batchers
(batcher.py), each formed batch sent within its shard's flow-control credit (credit.py) and its results read as
they finish (batch_send.py), and the one retry policy of flame_llm/serving/retry.py carried out on the answers: an
overloaded shard's request goes back to it after its hint until the request's overload deadline; a draining
shard's requests are routed to the other shards (its ShardWatch avoids that shard until its health says it serves
again), and so are those of a shard that died and did not come back (shard_watch.ShardLoss). The router hears which
routed requests are done (their completions, one call per loop tick). Runs on the client's loop."""
from __future__ import annotations

import asyncio
import logging
import time

import ray

from flame_llm.protocol.errors import ErrorInfo
from flame_llm.protocol.routing_key import Completion
from flame_llm.protocol.types import Result, ShardHealth
from flame_llm.serving.batch_send import BatchSender
from flame_llm.serving.batcher import ClientCodec, ClientCounters, Pending, ShardBatcher, attempt_id
from flame_llm.serving.client_config import ClientConfig
from flame_llm.serving.credit import Credit
from flame_llm.serving.retry import Action, Decision, decide
from flame_llm.serving.routing import ClientRouting
from flame_llm.serving.shard_watch import ShardLoss, ShardWatch, shard_by_name
from router.replica_client import Charge, RouterReplicas

log = logging.getLogger(__name__)
COMPLETIONS_PER_CALL = 256  # router completions buffered: sent once per loop tick, or when this many wait
ROUTER_CALL_WAIT_S = 2.0  # on close: how long router calls whose callers left are awaited (to forget their work)


class Dispatcher:
    def __init__(self, router, actors: dict[int, ray.actor.ActorHandle], model_revision: str, config: ClientConfig,
                 zstd_level: int, health: list[ShardHealth], max_payload_bytes: int, namespace: str,
                 client_id: str):
        self.router, self.actors, self.model_revision = RouterReplicas.of(router, namespace), actors, model_revision
        router = self.router
        self.max_retries = config.max_retries
        self.restart_timeout_s = config.restart_timeout_s
        self.max_model_len = min(h.limits.max_model_len for h in health)
        self.eos_token_ids = frozenset(t for h in health for t in h.eos_token_ids)  # one model revision: one set
        self.namespace, self.counters = namespace, ClientCounters()
        self.codec = ClientCodec(model_revision, zstd_level, self.counters)
        # the shards abort this client's requests when its Ray job (this process) dies; (job, client id) is this
        # client's turn in the shards' fair admission
        self.caller, self.client_id = ray.get_runtime_context().get_job_id(), client_id
        self.shards = ShardWatch(actors, router, health, config.restart_timeout_s, self.counters,
                                 lookup=shard_by_name(namespace), on_drop=lambda s: self.routing.drop_shard(s),
                                 on_conn_lost=lambda s, e: self.loss.watch_loss(s, e))  # its shard's end closed
        policy, max_entries, ttl_s = "cumulative", 100_000, 0.0
        if len(actors) > 1:  # the client places a known prefix under cumulative and events
            _, rc = router.config()
            policy, max_entries, ttl_s = rc.policy, rc.max_entries, rc.placement_ttl_s
        self.routing = ClientRouting(router, list(actors), self.shards, self.counters, config.restart_timeout_s,
                                     self.forget, policy, max_entries, ttl_s)
        self.batchers = {s: ShardBatcher(s, self.send, config.max_batch_prompts, config.batch_window_ms / 1000.0,
                                         max_payload_bytes) for s in actors}
        capacity = {s: h.admission_capacity for s, h in zip(actors, health, strict=True)}
        self.credit = Credit(capacity, config.max_batch_prompts, max_payload_bytes, self.shards.avoid,
                             self.counters, self._send_part, self._held_back, self.shards.restarting)
        self.loss = ShardLoss(self.shards, self.credit, self.max_retries, self.forget, self.route_again, self._spawn)
        self.sender = BatchSender(actors, self.caller, self.client_id, self.counters, self.codec,
                                  self.credit, self.settle, self.loss.shard_lost, self.forget, self.abort_on)
        self._tasks: set[asyncio.Task] = set()
        self._completions: list[Completion] = []  # for the router's next complete call
        self._charged: list[Charge] = []  # who charged each of them (router/replica_client.py)
        self._retrying: dict[int, tuple[asyncio.TimerHandle, Pending]] = {}  # id(p) -> its resend timer, p

    @property
    def outstanding(self) -> dict[int, int]:
        return self.credit.outstanding

    def abort_on(self, shard: int, request_ids: list[str]) -> None:
        """request_ids: the ids the attempts went under (batcher.attempt_id)."""
        self.counters.aborts_sent += len(request_ids)
        try:
            self.actors[shard].abort.remote(request_ids, self.caller)  # ids are the caller's own there
        except Exception as e:  # noqa: BLE001 - the shard is gone; so are its requests
            log.debug("abort on shard %d failed: %s", shard, e)

    def abandon(self, ps: list[Pending]) -> list[Pending]:
        """The callers gave up on ps (their futures are done): those still queued at the client (batch window,
        flow-control credit, overload resend delay) leave the queue and the router's count now and are never
        sent. The others are returned: in flight (to be aborted on their shards), or between shards (being
        routed, or their shard died: routing or ShardLoss.shard_lost forgets them)."""
        queued: list[Pending] = []
        for s in {p.shard for p in ps if p.shard >= 0}:
            gone = self.batchers[s].drop_abandoned() + self.credit.drop_abandoned(s)
            self.forget(s, gone)
            queued += gone
        for p in ps:
            resend = self._retrying.pop(id(p), None)
            if resend is not None:
                resend[0].cancel()
                self.forget(p.shard, [p])
                queued.append(p)
        left = {id(p) for p in queued}
        return [p for p in ps if id(p) not in left]

    async def route(self, batch: list[Pending]) -> None:
        """Route the requests and hand each to its shard's batcher (the failed ones get their result)."""
        shards = await self.route_shards(batch)
        for p, s in zip(batch, shards, strict=True):
            if isinstance(s, int):
                self.batchers[s].add(p)
        for s in {s for s in shards if isinstance(s, int)}:
            self.batchers[s].flush("formed")

    async def route_shards(self, batch: list[Pending]) -> list[int | ErrorInfo | None]:
        return await self.routing.route_shards(batch)

    # --- credit: the shard's flow control (credit.py) ---

    async def send(self, shard: int, batch: list[Pending]) -> None:
        """A formed batch of the shard's batcher: sent within the shard's credit."""
        self.credit.hold(shard, batch)

    def _send_part(self, shard: int, part: list[Pending]) -> None:
        self._spawn(self.sender.send(shard, part, len(part)))

    def _held_back(self, shard: int, gone: list[Pending], again: list[Pending]) -> None:
        """Held requests that leave the credit queue unsent: abandoned ones, and those of an avoided shard
        (routed again)."""
        self.forget(shard, gone + again)
        if again:
            self._spawn(self.route_again(again))

    async def take_credit(self, shard: int, user: str = "") -> None:
        await self.credit.take(shard, user)

    def give_credit(self, shard: int, n: int = 1) -> None:
        self.credit.give(shard, n)

    def forget(self, shard: int, ps: list[Pending]) -> None:
        """Routed requests that will not be answered by the shard: their estimated work leaves the router's
        count of the shard's outstanding work."""
        self.complete([completion(shard, p) for p in ps], ps)

    def complete(self, cs: list[Completion], ps: list[Pending]) -> None:
        """Completions for the router: sent in one call per loop tick (one per result payload before), or at
        once when COMPLETIONS_PER_CALL wait."""
        if not cs:
            return
        if not self._completions:
            try:
                asyncio.get_running_loop().call_soon(self.flush_completions)
            except RuntimeError:  # not on a loop: nothing would flush them later
                self._completions.extend(cs)
                self._charged.extend(p.charged for p in ps)
                self.flush_completions()
                return
        self._completions.extend(cs)
        self._charged.extend(p.charged for p in ps)
        if len(self._completions) >= COMPLETIONS_PER_CALL:
            self.flush_completions()

    def flush_completions(self) -> None:
        cs, charged, self._completions, self._charged = self._completions, self._charged, [], []
        if cs:
            self.counters.complete_calls += 1
            self.router.complete(cs, charged)

    async def settle_sends(self, timeout_s: float) -> None:
        """Wait up to timeout_s for the batches in flight to be answered (aborted requests answer at once): their
        completions reach the router before the client goes."""
        tasks = set(self._tasks).union(*(b.tasks for b in self.batchers.values()))
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def close(self) -> None:
        """What is left when the client goes (after settle_sends): resend timers and batch windows are cancelled,
        requests held or queued unsent leave the router's count, and the tasks still running (sends whose answers
        did not come, routing again, restart waits) are cancelled and awaited: a cancelled send forgets and
        aborts what it had in flight."""
        for handle, p in self._retrying.values():
            handle.cancel()
            self.forget(p.shard, [p])
        self._retrying.clear()
        for s, b in self.batchers.items():
            if b.timer is not None:
                b.timer.cancel()
                b.timer = None
            self.forget(s, b.items)
            b.items = []
        for s, held in self.credit.held.items():
            self.forget(s, [p for p in held if isinstance(p, Pending)])
            for item in held:
                if isinstance(item, asyncio.Future):
                    item.cancel()
            held.clear()
        if self.routing.calls:  # router calls whose callers left: their answers are forgotten as they come
            await asyncio.wait(set(self.routing.calls), timeout=ROUTER_CALL_WAIT_S)
        for _ in range(3):  # a cancelled task may start another (routing again): a few rounds
            tasks = set(self._tasks).union(*(b.tasks for b in self.batchers.values()))
            if not tasks:
                break
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.shards.stop()
        for t in list(self.routing.calls):
            t.cancel()
        self.flush_completions()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- the retry policy carried out ---

    async def settle(self, shard: int, pairs: list[tuple[Pending, Result]], sent: tuple[float, float]) -> None:
        """Each answered request's result goes to its caller, or the request is retried as the policy says.
        `sent`: (encoding began, the payload left)."""
        t_done = time.perf_counter()
        completions, done, reroute, now = [], [], [], time.monotonic()
        for p, r in pairs:
            assert r.id in (attempt_id(p), None), "a result answers its request's attempt"
            if p.future.done():  # abandoned by its caller (and aborted on the shard)
                completions.append(completion(shard, p))
                done.append(p)
                continue
            d = decide(p, self.max_retries, r, shard=shard, now=now)
            if d.action is Action.RETRY:  # the same shard, once its queue has room
                self.retry(p, d.delay_s)
                continue
            if d.action is Action.REROUTE:  # draining: another shard serves it
                reroute.append(p)
                completions.append(completion(shard, p))
                done.append(p)
                self.shards.avoid_shard(shard, r.error)
                continue
            r.id = p.request.id
            r.timings.update(encode_s=sent[1] - sent[0], roundtrip_s=t_done - sent[1], attempts=p.attempts + 1,
                             done_at=t_done)
            completions.append(completion(shard, p, r))
            done.append(p)
            p.future.set_result(r)
        self.complete(completions, done)
        if reroute:
            await self.route_again(reroute)

    async def apply(self, shard: int, p: Pending, d: Decision, r: Result | None, lost: BaseException | None) -> None:
        """Carry out a RETRY, REROUTE or RESTART decision for one request that is then sent again by its
        caller (a stream): the wait, the shard avoided, or the shard's restart watched (awaited when no other
        shard can serve it)."""
        p.attempts += 1
        self.counters.retries += 1
        if d.action is Action.RETRY:
            p.overloads += 1
            await asyncio.sleep(d.delay_s)
        elif d.action is Action.REROUTE:
            self.shards.avoid_shard(shard, r.error)
        else:
            assert d.action is Action.RESTART and lost is not None
            await self.loss.settle(shard, lost)

    async def route_again(self, ps: list[Pending]) -> None:
        ps = [p for p in ps if not p.future.done()]
        for p in ps:
            p.attempts += 1
        self.counters.retries += len(ps)
        if ps:
            await self.route(ps)

    def retry(self, p: Pending, delay_s: float) -> None:
        """Send an overloaded request to its shard again after delay_s (not counted against max_retries)."""
        p.attempts += 1
        p.overloads += 1
        self.counters.retries += 1
        self._retrying[id(p)] = (asyncio.get_running_loop().call_later(delay_s, self._retry_now, p), p)

    def _retry_now(self, p: Pending) -> None:
        self._retrying.pop(id(p), None)
        if p.future.done():  # abandoned during its retry delay
            self.forget(p.shard, [p])
        else:
            self.batchers[p.shard].add(p)


def completion(shard: int, p: Pending, r: Result | None = None) -> Completion:
    """The router's Completion of p on the shard: `r`, the shard's answer (its prompt and cached tokens count when
    it succeeded), or None: not served there (its estimated work only leaves the count)."""
    ok = r is not None and r.error is None
    return Completion(shard, p.est_work, p.est_decode, r.prompt_tokens if ok else 0, r.cached_tokens if ok else 0)

