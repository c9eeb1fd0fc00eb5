"""One shard as the client sees it (ShardChannel): its socket connection to the shard's current incarnation
(stream_conn.py; the engine actor's one request entry point), its queue and credit (shard_queue.py), its batches and
streams in flight, and the one retry policy (retry.py) carried out on its answers. Its Dispatcher (dispatch.py)
routes; ShardWatch (shard_watch.py) knows every shard's life. Runs on the client's loop.

A batch leaves as one BATCH frame; its results come back as they finish (credit given back per result). A stream is
one OPEN frame, its token chunks, then its result. The connection's end, or the client's walking away (CANCEL,
ABORT), ends their requests on the shard."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from contextlib import aclosing

from ray.exceptions import ActorUnschedulableError, RayActorError

from flame_llm.protocol.errors import ErrorCode, ErrorInfo
from flame_llm.protocol.stream_frames import Frame
from flame_llm.protocol.types import Result
from flame_llm.serving.owner import ChannelOwner
from flame_llm.serving.pending import Pending, attempt_id, failed_result
from flame_llm.serving.retry import Action, Decision, decide
from flame_llm.serving.shard_queue import ShardQueue
from flame_llm.serving.stream_conn import ShardLink, StreamConn

log = logging.getLogger(__name__)
# the router hears of a stream placed here (routing.place_stream) this long after its first token, once that token
# has reached the caller: the call takes ~0.5 ms of this loop, which a front door shares with the stream's SSE writer
# (told at once, it held the first token back ~0.5 ms at the door; bench/results/2026-12-01-cpu-hops-session3)
TELL_AFTER_S = 0.002
SHARD_LOST = (RayActorError, ActorUnschedulableError)  # the shard's actor died, or cannot be placed again


class ShardChannel(ShardQueue, ShardLink):
    def __init__(self, d: ChannelOwner, shard: int, capacity: int) -> None:
        cfg = d.config
        ShardQueue.__init__(self, capacity, cfg.max_batch_prompts, cfg.batch_window_ms / 1000.0,
                            d.limits.max_payload_bytes, d.counters)
        ShardLink.__init__(self, shard, d.actors, d.counters, d.caller, d.client_id)
        self.d = d
        self.tasks: set[asyncio.Task] = set()  # sends, reroutes and restart waits: awaited or cancelled on close
        self.retrying: dict[int, tuple[asyncio.TimerHandle, Pending]] = {}  # id(p) -> its resend timer, p

    # --- the queue's ---

    def avoided(self) -> bool:
        """Avoided, or restarting while another shard serves (else its requests wait here, then out its restart,
        as routing.avoid_now sends them: routed again, they came back at once, a router call per loop turn)."""
        w = self.d.shards
        return self.shard in w.avoid or self.shard in w.restarting and w.others_serve(self.shard)

    def send_part(self, part: list[Pending]) -> None:
        self.spawn(self.send(part))

    def held_back(self, gone: list[Pending], again: list[Pending]) -> None:
        self.d.routing.forget(self.shard, gone + again)
        if again:
            self.spawn(self.d.route_again(again))

    def spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests of this client's batches on the shard (request_ids: their attempts' ids)."""
        self.d.counters.aborts_sent += len(request_ids)
        if self.conn is not None:
            self.conn.abort(request_ids)

    # --- batches ---

    async def send(self, batch: list[Pending]) -> None:
        """Send a batch holding len(batch) units of credit, given back as its results land (all when it ends)."""
        held, conn, sid = len(batch), None, None
        waiting = {attempt_id(p): p for p in batch}  # sent and not yet answered (nor handed on: lost shard)
        d = self.d
        try:
            d.counters.batches += 1
            t0 = time.perf_counter()
            payload = d.codec.encode(batch)
            sent = (t0, time.perf_counter())
            try:
                conn = await self.connection()
                sid, q = conn.open(payload, d.caller, d.client_id, Frame.BATCH)
                while waiting:
                    item = await q.get()
                    if isinstance(item, BaseException):
                        raise item
                    results = d.codec.decode(item)
                    if len(results) == 1 and results[0].id is None:  # the shard could not read the batch
                        pairs = [(p, _for(p, results[0])) for p in waiting.values()]
                        waiting.clear()
                    else:
                        pairs = [(waiting.pop(r.id), r) for r in results]
                    n = min(len(pairs), held)  # credit comes back per result, not per batch
                    held -= n
                    if n:
                        self.give(n)
                    await self.settle(pairs, sent)
            except SHARD_LOST as e:
                lost = list(waiting.values())
                waiting.clear()
                await self.lost(lost, e)
        except asyncio.CancelledError:  # the client closes: the shard need not serve them, the router not count them
            self._left(waiting, conn, sid)
            raise
        except Exception as e:  # a bug or an unreadable result must not leave callers waiting forever
            log.exception("shard %d: batch of %d failed", self.shard, len(batch))
            for p in waiting.values():
                if not p.future.done():
                    p.future.set_result(failed_result(p, ErrorInfo(ErrorCode.CLIENT_ERROR,
                                                                   f"{type(e).__name__}: {e}")))
            self._left(waiting, conn, sid)
        finally:
            if conn is not None and sid is not None:
                conn.done(sid)
            if held:
                self.give(held)

    def _left(self, waiting: dict[str, Pending], conn: StreamConn | None, sid: int | None) -> None:
        """Unanswered requests of a batch given up: the router stops counting them, the shard aborts them."""
        left = list(waiting.values())
        self.d.routing.forget(self.shard, left)
        if left and conn is not None and sid is not None:
            self.d.counters.aborts_sent += len(left)
            conn.cancel(sid)

    async def settle(self, pairs: list[tuple[Pending, Result]], sent: tuple[float, float]) -> None:
        """Each answered request's result goes to its caller, or the request is retried as the policy says.
        `sent`: (encoding began, the payload left)."""
        t_done = time.perf_counter()
        done, reroute, now = [], [], time.monotonic()
        for p, r in pairs:
            assert r.id in (attempt_id(p), None), "a result answers its request's attempt"
            if p.future.done():  # abandoned by its caller (and aborted on the shard)
                done.append((p, None))
                continue
            dec = decide(p, self.d.config.max_retries, r, shard=self.shard, now=now)
            if dec.action is Action.RETRY:  # the same shard, once its queue has room
                self.retry(p, dec.delay_s)
                continue
            if dec.action is Action.REROUTE:  # draining: another shard serves it
                reroute.append(p)
                done.append((p, None))
                self.d.shards.avoid_shard(self.shard, r.error)
                continue
            r.id = p.request.id
            r.timings.update(encode_s=sent[1] - sent[0], roundtrip_s=t_done - sent[1], attempts=p.attempts + 1,
                             done_at=t_done)
            done.append((p, r))
            p.future.set_result(r)
        self.d.routing.complete(self.shard, done)
        if reroute:
            await self.d.route_again(reroute)

    def retry(self, p: Pending, delay_s: float) -> None:
        """Send an overloaded request to the shard again after delay_s (not counted against max_retries)."""
        p.attempts += 1
        p.overloads += 1
        self.d.counters.retries += 1
        self.retrying[id(p)] = (asyncio.get_running_loop().call_later(delay_s, self._retry_now, p), p)

    def _retry_now(self, p: Pending) -> None:
        self.retrying.pop(id(p), None)
        if p.future.done():  # abandoned during its retry delay
            self.d.routing.forget(self.shard, [p])
        else:
            self.add(p)

    # --- the shard's death ---

    async def lost(self, batch: list[Pending], e: BaseException) -> None:
        """The shard died with the batch in flight: route it again, at once when another shard can serve it (the
        dead one's cache is gone either way), else once it is back; when it does not come back, or cannot (its node
        is gone), the other shards serve it. Its work leaves the shard's count at the router now, once."""
        log.warning("shard %d failed with %d requests in flight (%s)", self.shard, len(batch), type(e).__name__)
        self.d.routing.forget(self.shard, batch)
        restarted = await self.after_death(e)
        again = []
        for p in batch:
            if p.future.done():
                continue
            dec = decide(p, self.d.config.max_retries, lost=e, shard=self.shard)
            if dec.action is Action.RESTART:
                again.append(p)
            elif restarted is not False:  # a request that keeps killing shards stops here
                p.future.set_result(failed_result(p, dec.error))
            else:
                p.future.set_result(failed_result(p, self.d.shards.avoid[self.shard]))
        await self.d.route_again(again)

    async def after_death(self, e: BaseException) -> bool | None:
        """After the shard died under requests that are sent again: None at once when another shard can serve them
        (the restart is watched meanwhile and routing leaves the shard out until it is back), else once the restart
        is over: True when it came back."""
        w = self.d.shards
        if not isinstance(e, ActorUnschedulableError) and w.others_serve(self.shard):
            w.restart(self.shard, e)  # restarting from now on: the requests routed again go elsewhere
            self.spawn(self.wait_restart(e))
            return None
        return await self.wait_restart(e)

    async def wait_restart(self, e: BaseException) -> bool:
        """Wait for the shard's restart (True); when it does not come back (or cannot), route around it. Meanwhile
        the requests held for its credit go to the other shards (a restart takes an engine's startup)."""
        fut = self.d.shards.restart(self.shard, e)
        self.release()
        if fut is not None and await asyncio.shield(fut):
            return True
        self.d.shards.lose_shard(self.shard, e)
        return False

    def watch_loss(self, e: BaseException) -> None:
        """The shard died under no request that is sent again (or its side ended the connection): its restart is
        still waited for, so new requests avoid it meanwhile."""
        self.spawn(self.wait_restart(e))

    # --- streams ---

    async def stream(self, p: Pending, streamed: list[int], push: Callable[[list[int]], None], split: dict[str, float],
                     untold: list[Pending]) -> tuple[Result | None, BaseException | None]:
        """One attempt of stream `p` here, within the shard's credit in its user's turn: each token chunk appended to
        `streamed` and pushed; (its result, None), or (None, the SHARD_LOST error) when the shard (or the connection)
        was lost under it; the router hears of its end (completion or forget). Cancelled: aborted on the shard.
        split gets credit_wait_s, sent_at and first_chunk_at_client (time.time(): the hop's ends, beside the actor's
        own). untold: p when the router is still to be told of its placement here (TELL_AFTER_S after the first
        chunk, or when it ends first)."""
        r = lost = None
        try:
            t0 = time.perf_counter()
            await self.take(p.request.user)
            split["credit_wait_s"] = time.perf_counter() - t0
            try:
                r = await self._stream_once(self.d.codec.encode([p]), streamed, push, split, untold)
            finally:
                self.give()
        except SHARD_LOST as e:
            lost = e
        finally:
            self._tell(untold)  # before the completion or forget below
            if r is None:  # lost, cancelled (the caller left, a stop string) or failed: not answered here
                self.d.routing.forget(self.shard, [p])
        if r is not None:
            self.d.routing.complete(self.shard, [(p, r)])
        return r, lost

    async def _stream_once(self, payload: bytes, streamed: list[int], push: Callable[[list[int]], None],
                           split: dict[str, float], untold: list[Pending]) -> Result:
        split["sent_at"] = time.time()
        items = self.stream_items(payload)
        telling = None
        async with aclosing(items):
            async for item in items:
                if isinstance(item, list):
                    if "first_chunk_at_client" not in split:
                        split["first_chunk_at_client"] = time.time()
                    streamed.extend(item)
                    push(item)
                    if untold and not telling:
                        telling = asyncio.get_running_loop().call_later(TELL_AFTER_S, self._tell, untold)
                    continue
                (r,) = self.d.codec.decode(item)
                return r
        raise RayActorError()  # the items ended without the result: the shard died under it

    def _tell(self, untold: list[Pending]) -> None:
        """Tell the router of a stream placed here without its call (routing.place_stream), once."""
        if untold:
            self.d.routing.tell(untold.pop(), self.shard)

    async def apply(self, p: Pending, dec: Decision, r: Result | None, lost: BaseException | None) -> None:
        """Carry out a RETRY, REROUTE or RESTART decision for a stream that its caller then sends again: the wait,
        the shard avoided, or the shard's restart watched (awaited when no other shard can serve it)."""
        p.attempts += 1
        self.d.counters.retries += 1
        if dec.action is Action.RETRY:
            p.overloads += 1
            await asyncio.sleep(dec.delay_s)
        elif dec.action is Action.REROUTE:
            self.d.shards.avoid_shard(self.shard, r.error)
        else:
            assert dec.action is Action.RESTART and lost is not None
            await self.after_death(lost)


def _for(p: Pending, r: Result) -> Result:
    """A batch-wide result (id None) as one request's."""
    return dataclasses.replace(r, id=attempt_id(p), timings=dict(r.timings))
