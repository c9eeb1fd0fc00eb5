"""Where the client's requests go: one router call per formed batch (router/actor.py), made again when it was lost
with a restarting router, leaving out the shards the client's ShardWatch routes around (draining, lost, and while
others serve: restarting).

A stream need not wait for the router: on a one-shard service it goes to that shard, and otherwise, when its prefix
is one the router placed before (the client remembers the router's answers: prefix block hash -> shard, an LRU), to
that shard at once. The router is told without waiting (its `place`), so its outstanding-work counts and prefix map
stay as if it had routed the stream. Only the `cumulative` policy places a known prefix on its owner whatever the
load, so only there (and on one shard) does a client place anything itself; the router alone places unseen prefixes,
and every request of a batch (one call per batch). Under the `events` policy the client's answers last the router's
placement_ttl_s (router/replicas.py RouteCache): a stream on a document routed that recently goes without a router
call, and after it the router decides again from what the engines hold (an eviction is seen within a TTL).

The router counts each shard's outstanding work; the requests it routed come back to it as completions (the shard's
answer, or none: not served there), one `complete` call per loop tick."""
from __future__ import annotations

import asyncio
import math
import time

from ray.exceptions import RayActorError

from flame_llm.protocol.errors import ErrorCode, ErrorInfo
from flame_llm.protocol.routing_key import Completion, RouteItem
from flame_llm.protocol.types import Result
from flame_llm.serving.pending import ClientCounters, Pending, failed_result
from flame_llm.serving.shard_watch import ShardWatch
from router.replica_client import Charge, RouterReplicas
from router.replicas import RouteCache

REROUTE_ROUNDS = 3  # route calls again for requests answered with a shard lost during the call
ROUTE_RETRY_MAX_S = 0.5  # a call lost with a restarting router is made again, after 0.1, 0.2, .. up to this, s
COMPLETIONS_PER_CALL = 256  # router completions buffered: sent once per loop tick, or when this many wait


class ClientRouting:
    def __init__(self, router: RouterReplicas, shards: list[int], watch: ShardWatch, counters: ClientCounters,
                 restart_timeout_s: float, policy: str = "cumulative", max_entries: int = 100_000,
                 ttl_s: float = 0.0) -> None:
        """policy, max_entries and ttl_s (placement_ttl_s): the router's."""
        self.router, self.shards, self.watch, self.counters = RouterReplicas.of(router), list(shards), watch, counters
        self.restart_timeout_s = restart_timeout_s
        self.local = len(self.shards) == 1 or policy in ("cumulative", "events")  # streams placed here
        self.single = self.shards[0] if len(self.shards) == 1 else None
        self.events = policy == "events"
        # prefix block hash -> shard, as the router answered: for ever under cumulative, placement_ttl_s under events
        self.cache = RouteCache(ttl_s if self.events else math.inf, max_entries) \
            if self.local and self.single is None else None
        self.calls: set[asyncio.Task] = set()  # router calls running (their callers may have left)
        self._completions: list[Completion] = []  # for the router's next complete call
        self._charged: list[Charge] = []  # who charged each of them (router/replica_client.py)

    def avoid_now(self) -> list[int]:
        """The shards to leave out now: those avoided (draining, lost) and, while another shard is left, those
        restarting (a request sent there waits out the restart). With every shard avoided, none: the answer says
        which shard the requests cannot reach."""
        hard = self.watch.avoid
        soft = set(hard) | self.watch.restarting
        if len(soft) < len(self.shards):
            return sorted(soft)
        return sorted(hard) if len(hard) < len(self.shards) else []

    def drop_shard(self, shard: int) -> None:
        """The shard restarted or was lost: its prefixes are no longer placed there."""
        if self.cache is not None:
            self.cache.drop_shard(shard)

    def place_stream(self, p: Pending) -> int | None:
        """The shard a stream goes to without asking the router (the caller then tells it: `tell`), or None: ask
        it."""
        if not self.local:
            return None
        avoid, now = self.avoid_now(), time.monotonic()
        s = self.single
        if s is None:  # under cumulative the deepest known prefix's shard or none, as the router's
            s = self.cache.lookup(p.chain, now, avoid if self.events else ())
        if s is None or s in avoid or s in self.watch.avoid:
            return None
        p.shard = s
        if self.cache is not None and not self.events:  # a placement lasts as long as a router's answer
            self.cache.learn(p.chain, s, now)
        self.counters.local_routes += 1
        return s

    def tell(self, p: Pending, shard: int) -> None:
        """Tell the router of a stream placed here (place_stream), before its completion or forget reaches it. The
        caller does it once the stream's first token is back: submitting a Ray call is ~0.5 ms of this process's
        time, and the router's run competes for the CPUs while the shard makes that token."""
        (p.charged,) = self.router.place([RouteItem(p.chain, p.est_work, p.est_decode)], [shard])

    async def route_shards(self, batch: list[Pending], rounds: int = REROUTE_ROUNDS) -> list[int | ErrorInfo | None]:
        """One router call for the batch: each request's shard (p.shard is set), or None when its caller gave up
        meanwhile, or the error it got (set as its result): the router is down, or no shard is left for it. A
        request answered with a shard lost while the call was out (avoided now, not when asked) is routed again
        while another shard serves (up to `rounds` more calls), not failed."""
        self.counters.route_calls += 1
        t0 = time.perf_counter()
        asked = self.avoid_now()
        call = asyncio.ensure_future(self.route_call([RouteItem(p.chain, p.est_work, p.est_decode) for p in batch],
                                                     asked))
        self.calls.add(call)
        call.add_done_callback(self.calls.discard)
        try:
            shards, charged = await asyncio.shield(call)
        except asyncio.CancelledError:  # the caller left: the router charges the work all the same; take it back
            call.add_done_callback(lambda c: self._forget_answer(c, batch))
            raise
        except Exception as e:  # the router is down: every request of the batch gets the error
            err = ErrorInfo(ErrorCode.ROUTER_ERROR, f"{type(e).__name__}: {e}")
            for p in batch:
                if not p.future.done():
                    p.future.set_result(failed_result(p, err))
            return [err] * len(batch)
        assert len(shards) == len(batch), "the router answers every request"
        self.counters.route_s += time.perf_counter() - t0
        out: list[int | ErrorInfo | None] = []
        again: list[int] = []  # positions answered with a shard lost during the call: routed again
        serving = any(x not in self.watch.avoid for x in self.shards)
        for p, s, c in zip(batch, shards, charged, strict=True):
            p.shard, p.charged = s, c
            why = self.watch.avoid.get(s)
            if p.future.done():  # abandoned while its route was asked for
                out.append(None)
            elif why is not None and s not in asked and serving and rounds > 0:  # lost during the call
                again.append(len(out))
                out.append(None)
            elif why is not None:  # no shard is left to serve it
                p.future.set_result(failed_result(p, why))
                out.append(why)
            else:
                out.append(s)
                if self.cache is not None:
                    self.cache.learn(p.chain, s, time.monotonic())
                continue
            self.forget(s, [p])
        if again:
            self.counters.route_retries += 1
            for i, r in zip(again, await self.route_shards([batch[i] for i in again], rounds - 1), strict=True):
                out[i] = r
        return out

    def _forget_answer(self, call: asyncio.Task, batch: list[Pending]) -> None:
        if call.cancelled() or call.exception() is not None:
            return
        for p, s, c in zip(batch, *call.result(), strict=True):
            p.charged = c
            self.forget(s, [p])

    async def route_call(self, items: list[RouteItem], avoid: list[int]) -> tuple[list[int], list[Charge]]:
        """One routing call (each item to its router replica, router/replica_client.py), made again while the
        routers restart: a call lost mid-call (the router died under it, or was restarting) is routed again until
        restart_timeout_s has passed, not failed after a fixed few tries that a slow restart outlasts."""
        deadline = time.monotonic() + self.restart_timeout_s
        attempt = 0
        while True:
            try:
                return await self.router.route(items, avoid)
            except RayActorError:
                if time.monotonic() >= deadline:
                    raise
                attempt += 1
                self.counters.route_retries += 1
                await asyncio.sleep(min(ROUTE_RETRY_MAX_S, 0.1 * attempt, max(0.0, deadline - time.monotonic())))

    # --- the router's count of outstanding work ---

    def forget(self, shard: int, ps: list[Pending]) -> None:
        """Routed requests that will not be answered by the shard: their estimated work leaves the router's
        count of the shard's outstanding work."""
        self.complete(shard, [(p, None) for p in ps])

    def complete(self, shard: int, done: list[tuple[Pending, Result | None]]) -> None:
        """Completions for the router (each request with the shard's answer, or None: not served there): sent in
        one call per loop tick, or at once when COMPLETIONS_PER_CALL wait."""
        if not done:
            return
        first = not self._completions
        self._completions.extend(completion(shard, p, r) for p, r in done)
        self._charged.extend(p.charged for p, _ in done)
        if first:
            try:
                asyncio.get_running_loop().call_soon(self.flush_completions)
            except RuntimeError:  # not on a loop: nothing would flush them later
                self.flush_completions()
                return
        if len(self._completions) >= COMPLETIONS_PER_CALL:
            self.flush_completions()

    def flush_completions(self) -> None:
        cs, charged, self._completions, self._charged = self._completions, self._charged, [], []
        if cs:
            self.counters.complete_calls += 1
            self.router.complete(cs, charged)


def completion(shard: int, p: Pending, r: Result | None = None) -> Completion:
    """The router's Completion of p on the shard: `r`, the shard's answer (its prompt and cached tokens count when
    it succeeded), or None: not served there (its estimated work only leaves the count)."""
    ok = r is not None and r.error is None
    return Completion(shard, p.est_work, p.est_decode, r.prompt_tokens if ok else 0, r.cached_tokens if ok else 0)
