"""One shard as the client sees it (ShardChannel): its socket connection to the shard's current incarnation
(stream_conn.py; the engine actor's one request entry point), its queue and credit (shard_queue.py), its batches and
streams in flight, and the one retry policy (retry.py) carried out on its answers: an overloaded answer goes back to
the shard after its hint until the request's overload deadline; a draining shard's requests are routed to the other
shards (the shard avoided until its health says it serves again); a shard that died has its restart watched, its
requests routed again at once when another shard can serve them, else once it is back, and when it does not come
back (or cannot: its node is gone) it is routed around. Its Dispatcher (dispatch.py) routes; ShardWatch
(shard_watch.py) knows every shard's life. Runs on the client's loop.

A batch leaves as one BATCH frame; its results come back as they finish (credit given back per result). A stream is
one OPEN frame, its token chunks, then its result. The connection's end, or the client's walking away (CANCEL,
ABORT), ends their requests on the shard."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import TYPE_CHECKING

import ray
from ray.exceptions import ActorUnschedulableError, RayActorError, RayError

from flame_llm.protocol.errors import ErrorCode, ErrorInfo
from flame_llm.protocol.stream_frames import Frame, StreamEndpoint, encode_frame, keepalive
from flame_llm.protocol.types import Result
from flame_llm.serving.pending import Pending, attempt_id, failed_result
from flame_llm.serving.retry import Action, Decision, decide
from flame_llm.serving.shard_queue import ShardQueue
from flame_llm.serving.stream_conn import CONNECT_TIMEOUT_S, StreamConn

if TYPE_CHECKING:
    from flame_llm.serving.dispatch import Dispatcher

log = logging.getLogger(__name__)
SHARD_LOST = (RayActorError, ActorUnschedulableError)  # the shard's actor died, or cannot be placed again


class ShardChannel(ShardQueue):
    def __init__(self, d: Dispatcher, shard: int, capacity: int) -> None:
        cfg = d.config
        super().__init__(capacity, cfg.max_batch_prompts, cfg.batch_window_ms / 1000.0, d.max_payload_bytes,
                         d.counters)
        self.d, self.shard = d, shard
        self.conn: StreamConn | None = None  # to the shard's current incarnation, once made
        self._connecting: asyncio.Future | None = None
        self.tasks: set[asyncio.Task] = set()  # sends, reroutes and restart waits: awaited or cancelled on close
        self.connects: set[asyncio.Task] = set()
        self.retrying: dict[int, tuple[asyncio.TimerHandle, Pending]] = {}  # id(p) -> its resend timer, p

    # --- the queue's ---

    def avoided(self) -> bool:
        w = self.d.shards
        return self.shard in w.avoid or self.shard in w.restarting

    def send_part(self, part: list[Pending]) -> None:
        self.spawn(self.send(part))

    def held_back(self, gone: list[Pending], again: list[Pending]) -> None:
        self.d.forget(self.shard, gone + again)
        if again:
            self.spawn(self.d.route_again(again))

    def spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # --- the connection ---

    async def connection(self) -> StreamConn:
        """The connection to the shard's current incarnation, made on first use (one connect, shared)."""
        if self.conn is not None and self.conn.broken is None:
            return self.conn
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())

            def over(f: asyncio.Future) -> None:
                self._connecting = None
                if not f.cancelled():
                    f.exception()  # retrieved: each waiter raises it (none may be left)

            self._connecting.add_done_callback(over)
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> StreamConn:
        # this node's id: a shard on it answers its loopback address (actors/engine_actor.py stream_endpoint)
        node = ray.get_runtime_context().get_node_id()
        ep: StreamEndpoint = await self.d.actors[self.shard].stream_endpoint.remote(node)  # RayActorError: dead
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(ep.host, ep.port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            raise RayActorError(error_msg=f"shard {self.shard}'s stream server at {ep.host}:{ep.port} does not "
                                          f"answer: {type(e).__name__}: {e}") from None
        keepalive(writer.get_extra_info("socket"))
        writer.write(encode_frame(Frame.HELLO, ep.token))
        self.conn = StreamConn(self.shard, ep, reader, writer, self.conn_lost)
        log.debug("shard %d: connection to %s:%d", self.shard, ep.host, ep.port)
        return self.conn

    def keep_connected(self) -> None:
        """Open the connection now (and again after each restart: ShardWatch), whether or not a request uses it:
        when the shard's process dies its connection ends, and the client routes around it at once."""
        async def quietly() -> None:
            try:
                await self.connection()
            except (RayError, OSError, asyncio.TimeoutError):  # dead now: its requests find out
                pass

        task = asyncio.get_running_loop().create_task(quietly())
        self.connects.add(task)
        task.add_done_callback(self.connects.discard)

    def conn_lost(self, shard: int, e: RayActorError) -> None:
        """The shard's side ended the connection: the shard likely died; new requests go around it meanwhile."""
        self.watch_loss(e)

    def drop_conn(self, why: str, keep: str | None = None) -> None:
        """The shard is a new incarnation: the old connection (broken with it) goes. keep: the incarnation that
        answers now; a connection already made to it stays (a stream sent since the restart runs on it)."""
        if self.conn is not None and self.conn.endpoint.incarnation != keep:
            conn, self.conn = self.conn, None
            conn.close(why)

    async def close(self) -> None:
        """The client goes: its connection closes (the shard ends what is left on it)."""
        for t in list(self.connects):
            t.cancel()
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close("the client closed")
        await asyncio.gather(*self.connects, *([conn.reader] if conn is not None else []), return_exceptions=True)

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
        self.d.forget(self.shard, left)
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
            dec = decide(p, self.d.max_retries, r, shard=self.shard, now=now)
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
        self.d.complete(self.shard, done)
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
            self.d.forget(self.shard, [p])
        else:
            self.add(p)

    # --- the shard's death ---

    async def lost(self, batch: list[Pending], e: BaseException) -> None:
        """The shard died with the batch in flight: route it again, at once when another shard can serve it (the
        dead one's cache is gone either way), else once it is back; when it does not come back, or cannot (its node
        is gone), the other shards serve it. Its work leaves the shard's count at the router now, once."""
        log.warning("shard %d failed with %d requests in flight (%s)", self.shard, len(batch), type(e).__name__)
        self.d.forget(self.shard, batch)
        restarted = await self.after_death(e)
        again = []
        for p in batch:
            if p.future.done():
                continue
            dec = decide(p, self.d.max_retries, lost=e, shard=self.shard)
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
        if not isinstance(e, ActorUnschedulableError) and any(
                s != self.shard and s not in w.avoid and s not in w.restarting for s in w.actors):
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
        """The shard died under no request that is sent again: its restart is still waited for, so new requests
        avoid it meanwhile."""
        self.spawn(self.wait_restart(e))

    # --- streams ---

    async def stream_items(self, payload: bytes) -> AsyncIterator[list[int] | bytes]:
        """One stream on the shard: lists of token ids, then the result payload. RayActorError when the connection
        cannot be made or breaks; closed before its result (cancelled), the shard is told to abort it."""
        conn = await self.connection()
        sid, q = conn.open(payload, self.d.caller, self.d.client_id)
        item = None
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, bytes):
                    return
        except (asyncio.CancelledError, GeneratorExit):  # cancelled, or closed before its result: abort it there
            if not isinstance(item, bytes):
                self.d.counters.aborts_sent += 1
                conn.cancel(sid)
            raise
        finally:
            conn.done(sid)

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
