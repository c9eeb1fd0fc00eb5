"""The client's work on its loop: a generate call's requests (`generate`) and streams (`stream`) are made
(pending.py), routed (routing.py: one router call per formed batch; a stream whose prefix's shard is known goes
there at once) and each handed to its shard's channel (channel.py: its connection, queue, credit and the retry
policy carried out on its answers). The Dispatcher holds the channels (shard -> ShardChannel), the routing (which
also tells the router which routed requests are done) and what it knows of the shards' lives (shard_watch.py).

A generate call its caller gives up on (cancelled) takes its unanswered requests out of the client's queues unsent
and has the shards abort the others. A stream goes on after its shard's death from its last token (retry.py's
continuation): no token repeated or skipped; cancelling the task that runs it aborts it on its shard."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import ray

from flame_llm.protocol.types import EngineLimits, Request, Result, ShardHealth, prompt_digest
from flame_llm.protocol.wire import request_wire_size
from flame_llm.sampling_params import SamplingParams
from flame_llm.serving.channel import ShardChannel
from flame_llm.serving.client_config import ClientConfig
from flame_llm.serving.pending import (
    ClientCodec,
    ClientCounters,
    Pending,
    RequestMaker,
    StreamChunk,
    attempt_id,
    failed_result,
    set_estimates,
)
from flame_llm.serving.retry import Action, continuation, decide, stream_end
from flame_llm.serving.routing import ClientRouting
from flame_llm.serving.shard_watch import ShardWatch
from flame_llm.serving.stream_conn import StreamConn
from flame_llm.validate import check_number
from router.replica_client import RouterReplicas

SETTLE_WAIT_S = 2.0  # on close: how long the aborted requests' answers are awaited (their router completions)
ROUTER_CALL_WAIT_S = 2.0  # on close: how long router calls whose callers left are awaited (to forget their work)


class Dispatcher:
    def __init__(self, router, actors: dict[int, ray.actor.ActorHandle], health: list[ShardHealth],
                 config: ClientConfig, zstd_level: int, namespace: str, client_id: str):
        """health: each shard's (one model revision: the limits, the tokenizer, the EOS ids)."""
        self.router, self.actors = RouterReplicas.of(router, namespace), actors
        self.config, self.model_revision = config, health[0].model_revision
        self.limits = EngineLimits.tightest([h.limits for h in health])  # what every shard accepts
        self.eos_token_ids = frozenset(t for h in health for t in h.eos_token_ids)  # one model revision: one set
        self.counters = ClientCounters()
        self.requests = RequestMaker(self.limits, self.model_revision, health[0].model, client_id,
                                     config.overload_deadline_s, health[0].tokenizer)
        self.codec = ClientCodec(self.model_revision, zstd_level, self.counters)
        # (Ray job, client id): this client's turn in the shards' fair admission (its requests are aborted there
        # when its stream connections end: actors/inflight.py)
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

    async def route_again(self, ps: list[Pending]) -> None:
        ps = [p for p in ps if not p.future.done()]
        for p in ps:
            p.attempts += 1
        self.counters.retries += len(ps)
        if ps:
            await self.route(ps)

    # --- calls ---

    async def generate(self, prompts: list, sampling_params: SamplingParams | list[SamplingParams], use_tqdm: bool,
                       deadline_s: float | None, on_result: Callable[[int, Result], None] | None = None,
                       user: str = "") -> list[Result]:
        """Each prompt's Result in input order; on_result(index, result) is called as each lands. deadline_s: the
        requests' overload deadline (None: ClientConfig.overload_deadline_s)."""
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries; prompts has {len(prompts)}")
        check_number("overload_deadline_s", deadline_s, 0, optional=True, where="argument")  # as ClientConfig's
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(prompts), desc="requests")

        def landed(i: int, fut: asyncio.Future) -> None:
            if fut.cancelled():
                return
            r = fut.result()
            r.timings["client_s"] = time.perf_counter() - t0  # this request's time in the call
            tok = self.requests.tokenizer
            if tok is not None and r.error is None:
                r.text = tok.decode(r.output_token_ids)
            if bar is not None:
                bar.update(1)
            if on_result is not None:
                on_result(i, r)

        pend = [self.requests.prepare(prompt, sp, loop, deadline_s, user)
                for prompt, sp in zip(prompts, sampling_params, strict=True)]
        for i, p in enumerate(pend):
            p.future.add_done_callback(lambda f, i=i: landed(i, f))
        try:
            routed = [p for p in pend if not p.future.done()]
            if routed:
                await self.route(routed)
            return await asyncio.gather(*(p.future for p in pend))  # after each `landed`: added first
        except asyncio.CancelledError:
            self.abandon(pend)
            raise
        finally:
            if bar is not None:
                bar.close()

    async def stream(self, prompt, sp: SamplingParams, push: Callable[[StreamChunk], None], user: str = "") -> None:
        """One streamed request: each token chunk handed to `push`, then a last chunk with its Result
        (output_token_ids: what was streamed; prompt_tokens: the caller's prompt; timings["resumed"]: how many times
        it went on from its last token after its shard died)."""
        t0 = time.perf_counter()
        p = self.requests.prepare(prompt, sp, asyncio.get_running_loop(), user=user)
        self.counters.streams += 1
        result = p.future.result() if p.future.done() else await self._stream(p, push)
        result.timings["client_s"] = time.perf_counter() - t0
        push(StreamChunk([], result))

    async def _stream(self, p: Pending, push: Callable[[StreamChunk], None]) -> Result:
        rid, original, streamed = p.request.id, p.request, []
        resumed = 0
        split: dict[str, float] = {}  # the last attempt's route_s, credit_wait_s, sent_at, first_chunk_at_client
        while True:
            t0 = time.perf_counter()
            # placed here when its prefix's shard is known (routing.place_stream; the channel tells the router
            # after its first token: `untold`), else the router's answer
            shard, untold = self.routing.place_stream(p), [p]
            if shard is None:
                (shard,), untold = await self.routing.route_shards([p]), []
            split["route_s"] = time.perf_counter() - t0
            if not isinstance(shard, int):  # the router is down, or no shard is left to serve it
                result = p.future.result()
                break
            ch, before = self.channels[shard], len(streamed)
            split.pop("first_chunk_at_client", None)  # this attempt's
            r, lost = await ch.stream(p, streamed, lambda toks: push(StreamChunk(toks)), split, untold)
            now_streamed = len(streamed) > before  # earlier attempts' tokens are in this attempt's prompt
            end = (stream_end(original, streamed, self.limits.max_model_len, self.eos_token_ids)
                   if lost is not None and now_streamed else None)
            decision = decide(p, self.config.max_retries, r, lost, shard, streamed=now_streamed, complete=end)
            if decision.action is Action.DONE and r is None:  # the shard died after the stream's last token
                ch.watch_loss(lost)
                result = Result(rid, finish_reason=decision.finish_reason, shard=shard)
                _as_asked(result, original)
                break
            if decision.action is Action.DONE:
                result = r
                break
            if decision.action is Action.FAIL:
                if lost is not None:  # the stream ends here, but new requests avoid the shard while it restarts
                    ch.watch_loss(lost)
                result = failed_result(p, decision.error)
                break
            await ch.apply(p, decision, r, lost)
            if lost is not None and now_streamed:  # go on from the last token (the caller's request is untouched)
                p.request = continuation(original, streamed)
                p.wire_bytes = request_wire_size(len(p.request.prompt_token_ids),
                                                 len(p.request.sampling.stop_token_ids))
                set_estimates(p, self.model_revision, self.limits.max_model_len)
                resumed += 1
                self.counters.stream_resumes += 1
        result.id = rid
        result.output_token_ids = list(streamed) if streamed else list(result.output_token_ids)
        if resumed:
            _as_asked(result, original)
        result.timings.update(split, attempts=p.attempts + 1, resumed=resumed)
        return result

    # --- closing ---

    def _tasks(self) -> set[asyncio.Task]:
        return set().union(*(c.tasks for c in self.channels.values()))

    async def close(self) -> None:
        """The client goes. The batches in flight are awaited up to SETTLE_WAIT_S (aborted requests answer at once):
        their completions reach the router first. Then resend timers and batch windows are cancelled, requests held
        or queued unsent leave the router's count, and the tasks still running (sends whose answers did not come,
        routing again, restart waits) are cancelled and awaited: a cancelled send forgets and aborts what it had in
        flight."""
        if tasks := self._tasks():
            await asyncio.wait(tasks, timeout=SETTLE_WAIT_S)
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


def _as_asked(result: Result, original: Request) -> None:
    """A resumed stream's result (or one its streamed tokens ended) reports the prompt its caller sent, not the
    continuation's."""
    result.prompt_tokens = len(original.prompt_token_ids)
    result.cached_tokens = min(result.cached_tokens, result.prompt_tokens)
    result.prompt_digest = prompt_digest(original.prompt_token_ids)
