"""A stream whose first chunk comes back from a plain actor call (EngineActor.stream_open) and the rest through a
Ray streaming generator (EngineActor.stream_rest): the transport of ClientConfig.stream_open_call.

On CPU a Ray streaming generator costs ~0.6 ms more than a plain actor call to start and ~0.5 ms more to bring an
item back (bench/results/2026-12-01-cpu-hops-session3/README.md), and a stream's first token pays both. The client
sends `stream_open(payload)` and `stream_rest(request_id)` at once: the plain call starts the request and answers
its first token ids (or, when it ends first, its result payload); the generator, started while the first token is
made, yields the later chunks and then the result payload, so later tokens travel as they do with `stream` (one
generator item each, no call per chunk).

A stream whose caller stops reading (it was cancelled and aborted the request, or its job died: the request ends
through Inflight either way) keeps its result payload KEEP_UNREAD_S after it ends, then is dropped."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from flame_llm.protocol.types import ErrorCode, ErrorInfo, Result

KEEP_UNREAD_S = 60.0  # an ended stream's result waits this long for its reader
FIND_TIMEOUT_S = 5.0  # stream_rest waits this long for its stream_open to register the stream


@dataclass(slots=True)
class PolledStream:
    """One request streamed by stream_open + stream_rest: tokens sampled and not yet answered, then its result."""
    arrived_at: float  # time.time() when stream_open ran (the hop split of bench/hops.py)
    tokens: list[int] = field(default_factory=list)
    result: bytes | None = None  # the result payload once the request ended
    waiter: asyncio.Future | None = None  # the reader waiting for tokens or the result
    first_taken: asyncio.Future | None = None  # done when stream_open has answered (stream_rest reads after it)
    task: asyncio.Task | None = None
    first_chunk_at: float | None = None  # time.time() when the first answer with tokens left

    def push(self, tokens: list[int]) -> None:
        """The engine's new tokens (the request's emit callback, on the actor's loop)."""
        self.tokens += tokens
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class PollStreams:
    """The open streams of one engine actor, by the key their caller gave (one per attempt of a request: a retry
    on the same shard opens a new stream while its last attempt's stream_rest may still be on its way)."""

    def __init__(self, keep_unread_s: float = KEEP_UNREAD_S, find_timeout_s: float = FIND_TIMEOUT_S) -> None:
        self.streams: dict[str, PolledStream] = {}
        self.keep_unread_s, self.find_timeout_s = keep_unread_s, find_timeout_s
        self._opening: dict[str, asyncio.Future] = {}  # key -> stream_rest waiting for its stream_open
        self.counters = {"open_streams": 0, "unread_dropped": 0, "rest_not_found": 0}

    def open(self, key: str, arrived_at: float) -> PolledStream | None:
        """A new stream, or None when one with this key is still here (running, or its result unread)."""
        if key in self.streams:
            return None
        loop = asyncio.get_running_loop()
        s = self.streams[key] = PolledStream(arrived_at, first_taken=loop.create_future())
        self.counters["open_streams"] += 1
        if (f := self._opening.pop(key, None)) is not None and not f.done():
            f.set_result(s)
        return s

    async def find(self, key: str) -> PolledStream | None:
        """The stream of this key, waiting up to find_timeout_s for its stream_open (Ray does not promise that an
        async actor starts one caller's calls in order)."""
        s = self.streams.get(key)
        if s is not None:
            return s
        f = self._opening.setdefault(key, asyncio.get_running_loop().create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(f), self.find_timeout_s)
        except TimeoutError:
            self.counters["rest_not_found"] += 1
            return None
        finally:
            if self._opening.get(key) is f:
                del self._opening[key]

    def ended(self, key: str, s: PolledStream, payload: bytes) -> None:
        """The request ended with this result payload; it is answered to the next read or dropped later."""
        s.result = payload
        s._wake()
        asyncio.get_running_loop().call_later(self.keep_unread_s, self._drop_unread, key, s)

    def _drop_unread(self, key: str, s: PolledStream) -> None:
        if self.streams.get(key) is s:
            del self.streams[key]
            self.counters["unread_dropped"] += 1

    async def next(self, key: str, s: PolledStream, last: bool = True) -> list[int] | bytes:
        """What the reader has not seen: new tokens (a list), or the result payload (bytes), which ends the stream
        and carries every token (so tokens still unanswered travel in it). last: the result is read no more
        (stream_open answering a result leaves it for its stream_rest)."""
        if not s.tokens and s.result is None:
            assert s.waiter is None, f"two readers at once on stream {key}"
            s.waiter = asyncio.get_running_loop().create_future()
            try:
                await s.waiter
            finally:
                s.waiter = None
        if s.result is not None:
            if last and self.streams.get(key) is s:
                del self.streams[key]
            return s.result
        out, s.tokens = s.tokens, []
        if s.first_chunk_at is None:
            s.first_chunk_at = time.time()
        return out


async def open_stream(actor, payload: bytes, key: str, caller: str | None, client: str | None,
                      polled: bool) -> list[int] | bytes:
    """EngineActor.stream_open on `actor` (an EngineActor): start the request, answer its first chunk."""
    arrived_at = time.time()
    item = actor._one_request(payload)
    if isinstance(item, Result):
        return actor._encode([item])
    s = actor.polls.open(key, arrived_at)
    if s is None:
        return actor._encode([actor._result(item.id, error=ErrorInfo(
            ErrorCode.DUPLICATE_ID, f"shard {actor.name} already has a stream keyed {key!r}"))])
    actor.counters["streams"] += 1
    s.task = asyncio.get_running_loop().create_task(actor._serve(item, time.perf_counter(), caller, s.push, client))
    s.task.add_done_callback(lambda t: _ended(actor, key, item.id, s, t))
    try:
        return await actor.polls.next(key, s, last=polled)
    finally:
        s.first_taken.set_result(None)


async def stream_rest(actor, key: str):
    """EngineActor.stream_rest on `actor`: the chunks after the first, then the result payload."""
    s = await actor.polls.find(key)
    if s is None:
        yield actor._encode([actor._result(None, error=ErrorInfo(
            ErrorCode.BAD_REQUEST, f"shard {actor.name} has no stream keyed {key!r} (its stream_open did not arrive "
                                   f"within {actor.polls.find_timeout_s:g} s, or its result went unread for "
                                   f"{actor.polls.keep_unread_s:g} s)"))])
        return
    await s.first_taken
    while isinstance(item := await actor.polls.next(key, s), list):
        yield item
    yield item


async def next_polled(actor, key: str) -> list[int] | bytes:
    """EngineActor.stream_next on `actor`."""
    s = actor.polls.streams.get(key)
    if s is None:
        return actor._encode([actor._result(None, error=ErrorInfo(
            ErrorCode.BAD_REQUEST, f"shard {actor.name} has no stream keyed {key!r} (never opened, or its result "
                                   f"went unread for {actor.polls.keep_unread_s:g} s)"))])
    return await actor.polls.next(key, s)


def _ended(actor, key: str, request_id: str, s: PolledStream, task: asyncio.Task) -> None:
    if task.cancelled():  # the actor is shutting down
        res = actor._result(request_id, finish_reason="abort")
    elif (e := task.exception()) is not None:
        res = actor._result(request_id, error=ErrorInfo(ErrorCode.ENGINE_ERROR, f"{type(e).__name__}: {e}"))
    else:
        res = task.result()
    res.timings["arrived_at"] = s.arrived_at
    res.timings["first_chunk_at"] = s.first_chunk_at or time.time()
    actor.polls.ended(key, s, actor._encode([res]))
