"""How the client's requests reach the shards: one router call per formed batch (routing.py), then each request to
its shard's channel (channel.py: its connection, queue, credit and the retry policy carried out on its answers).
The Dispatcher holds the channels (shard -> ShardChannel), the routing (which also tells the router which routed
requests are done) and what it knows of the shards' lives (shard_watch.py). Runs on the client's loop."""
from __future__ import annotations

import asyncio
import logging

import ray

from flame_llm.protocol.errors import ErrorInfo
from flame_llm.protocol.types import EngineLimits, ShardHealth
from flame_llm.serving.channel import ShardChannel
from flame_llm.serving.client_config import ClientConfig
from flame_llm.serving.pending import ClientCodec, ClientCounters, Pending, attempt_id
from flame_llm.serving.routing import ClientRouting
from flame_llm.serving.shard_watch import ShardWatch
from flame_llm.serving.stream_conn import StreamConn
from router.replica_client import RouterReplicas

log = logging.getLogger(__name__)
ROUTER_CALL_WAIT_S = 2.0  # on close: how long router calls whose callers left are awaited (to forget their work)


class Dispatcher:
    def __init__(self, router, actors: dict[int, ray.actor.ActorHandle], model_revision: str, config: ClientConfig,
                 zstd_level: int, health: list[ShardHealth], limits: EngineLimits, namespace: str, client_id: str):
        """limits: what every shard accepts (EngineLimits.tightest of their health's)."""
        self.router, self.actors, self.model_revision = RouterReplicas.of(router, namespace), actors, model_revision
        self.config, self.limits = config, limits
        self.eos_token_ids = frozenset(t for h in health for t in h.eos_token_ids)  # one model revision: one set
        self.namespace, self.counters = namespace, ClientCounters()
        self.codec = ClientCodec(model_revision, zstd_level, self.counters)
        # the shards abort this client's requests when its Ray job (this process) dies; (job, client id) is this
        # client's turn in the shards' fair admission
        self.caller, self.client_id = ray.get_runtime_context().get_job_id(), client_id
        self.shards = ShardWatch(actors, self.router, health, config.restart_timeout_s, self.counters,
                                 namespace, owner=self)
        self.channels = {s: ShardChannel(self, s, h.admission_capacity) for s, h in zip(actors, health, strict=True)}
        policy, max_entries, ttl_s = "cumulative", 100_000, 0.0
        if len(actors) > 1:  # the client places a known prefix under cumulative and events
            _, rc = self.router.config()
            policy, max_entries, ttl_s = rc.policy, rc.max_entries, rc.placement_ttl_s
        self.routing = ClientRouting(self.router, list(actors), self.shards, self.counters, config.restart_timeout_s,
                                     policy, max_entries, ttl_s)

    @property
    def outstanding(self) -> dict[int, int]:
        return {s: c.outstanding for s, c in self.channels.items()}

    @property
    def conns(self) -> dict[int, StreamConn]:
        """The shards' connections made so far."""
        return {s: c.conn for s, c in self.channels.items() if c.conn is not None}

    def keep_connected(self) -> None:
        """Every shard's connection open from now on (channel.py keep_connected). On the loop."""
        for c in self.channels.values():
            c.keep_connected()

    def shard_changed(self, shard: int, incarnation: str | None = None) -> None:
        """The shard restarted (`incarnation`: the one that answers now) or was lost (None): its prefixes are no
        longer placed there, and a new incarnation's connection replaces the dead one's (ShardWatch)."""
        self.routing.drop_shard(shard)
        if incarnation is not None:
            # a connection a stream already made to the new incarnation stays (closing it ended the streams on it
            # and sent them again: session 7's H200 shard-kill run)
            self.channels[shard].drop_conn("the shard restarted", keep=incarnation)
            self.channels[shard].keep_connected()

    def abandon(self, ps: list[Pending]) -> None:
        """The caller gave up on ps: those not answered yet are cancelled. Those still queued at the client (batch
        window, flow-control credit, overload resend delay) leave the queue and the router's count now and are never
        sent; those in flight are aborted on their shards (fire and forget: a shard that is gone has nothing to
        abort); those between shards (being routed, or their shard died) are forgotten by routing or
        ShardChannel.lost."""
        gone = []
        for p in ps:
            if not p.future.done() or p.future.cancelled():
                p.future.cancel()
                gone.append(p)
        queued: set[int] = set()
        for s in {p.shard for p in gone if p.shard >= 0}:
            dropped = self.channels[s].drop_abandoned()
            self.routing.forget(s, dropped)
            queued.update(map(id, dropped))
        by_shard: dict[int, list[str]] = {}
        for p in gone:
            resend = self.channels[p.shard].retrying.pop(id(p), None) if p.shard >= 0 else None
            if resend is not None:
                resend[0].cancel()
                self.routing.forget(p.shard, [p])
            elif p.shard >= 0 and id(p) not in queued:
                by_shard.setdefault(p.shard, []).append(attempt_id(p))
        for s, ids in by_shard.items():
            self.channels[s].abort(ids)

    async def route(self, batch: list[Pending]) -> None:
        """Route the requests and hand each to its shard's channel (the failed ones get their result)."""
        shards = await self.routing.route_shards(batch)
        for p, s in zip(batch, shards, strict=True):
            if isinstance(s, int):
                self.channels[s].add(p)
        for s in {s for s in shards if isinstance(s, int)}:
            self.channels[s].flush("formed")

    async def place_stream(self, p: Pending) -> tuple[int | ErrorInfo | None, list[Pending]]:
        """A stream's shard, and [p] when it was placed here without the router's call (its prefix's shard known:
        routing.place_stream; the channel tells the router after its first token), else the router's answer and
        []."""
        shard = self.routing.place_stream(p)
        if shard is not None:
            return shard, [p]
        (shard,) = await self.routing.route_shards([p])
        return shard, []

    async def route_again(self, ps: list[Pending]) -> None:
        ps = [p for p in ps if not p.future.done()]
        for p in ps:
            p.attempts += 1
        self.counters.retries += len(ps)
        if ps:
            await self.route(ps)

    # --- closing ---

    def _tasks(self) -> set[asyncio.Task]:
        return set().union(*(c.tasks for c in self.channels.values()))

    async def settle_sends(self, timeout_s: float) -> None:
        """Wait up to timeout_s for the batches in flight to be answered (aborted requests answer at once): their
        completions reach the router before the client goes."""
        tasks = self._tasks()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def close(self) -> None:
        """What is left when the client goes (after settle_sends): resend timers and batch windows are cancelled,
        requests held or queued unsent leave the router's count, and the tasks still running (sends whose answers
        did not come, routing again, restart waits) are cancelled and awaited: a cancelled send forgets and
        aborts what it had in flight."""
        for s, c in self.channels.items():
            for handle, p in c.retrying.values():
                handle.cancel()
                self.routing.forget(s, [p])
            c.retrying.clear()
            self.routing.forget(s, c.take_all())
        if self.routing.calls:  # router calls whose callers left: their answers are forgotten as they come
            await asyncio.wait(set(self.routing.calls), timeout=ROUTER_CALL_WAIT_S)
        for _ in range(3):  # a cancelled task may start another (routing again): a few rounds
            tasks = self._tasks()
            if not tasks:
                break
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.shards.stop()
        await asyncio.gather(*(c.close() for c in self.channels.values()))
        for t in list(self.routing.calls):
            t.cancel()
        self.routing.flush_completions()
