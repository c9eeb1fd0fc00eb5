"""The client's request state (Pending, ClientCounters) and its per-shard request queues: a formed batch leaves
when it reaches max_prompts, its window runs out, the next request would pass the decoded payload budget, or
the client says the batch is formed.

ClientCodec: the client's use of the one wire codec (flame_llm/protocol/wire.py): request payloads encoded for the
service's model revision and zstd level, result payloads decoded, their sizes and times added to the client's
counters. Batches (batch_send.py) and streams (client_stream.py) alike."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import asdict, dataclass

from flame_llm.limits import max_output_tokens
from flame_llm.protocol.errors import ErrorInfo
from flame_llm.protocol.routing_key import estimate_prefill_work, prefix_chain
from flame_llm.protocol.types import Request, Result
from flame_llm.protocol.wire import BATCH_OVERHEAD, decode_results, decoded_size, encode_requests
from router.replica_client import NO_CHARGE, Charge


@dataclass(slots=True)
class Pending:
    """A request in the client's hands: routed, queued, in flight or waiting to be retried."""
    request: Request  # prompt_token_ids: uint32 array
    chain: list[int]
    est_work: float
    wire_bytes: int
    future: asyncio.Future
    shard: int = -1
    attempts: int = 0  # sends after the first, of any kind
    overloads: int = 0  # of those, resends after an overloaded answer: not counted against max_retries
    est_decode: int = 0  # output tokens it can produce (flame_llm.limits.max_output_tokens): the router's estimate
    deadline: float = math.inf  # time.monotonic() past which an overloaded answer is its result (no retry)
    charged: Charge = NO_CHARGE  # the router replica that counts its work (router/replica_client.py)


def set_estimates(p: Pending, model_revision: str, max_model_len: int) -> None:
    """p's routing identity and the router's estimates, from its (checked) request: the prompt's prefix chain,
    its prefill work, and the output tokens it can produce."""
    n = len(p.request.prompt_token_ids)
    p.chain = prefix_chain(p.request.prompt_token_ids, model_revision)
    p.est_work = estimate_prefill_work(n)
    p.est_decode = max_output_tokens(n, p.request.sampling.max_tokens, max_model_len)


def attempt_id(p: Pending) -> str:
    """The id p's current attempt carries to its shard: the caller's id on the first send, `id~k` on the k-th send
    after it. A shard holds one request per id (AsyncEngine refuses a second while the first is in flight), and an
    attempt the client walked away from may still be there, being aborted (its connection closed) or not yet
    stopped, when the next attempt arrives; and an abort then names one attempt, not its successor."""
    return p.request.id if p.attempts == 0 else f"{p.request.id}~{p.attempts}"


def failed_result(p: Pending, error: ErrorInfo) -> Result:
    return Result(p.request.id, prompt_tokens=len(p.request.prompt_token_ids), shard=p.shard, error=error)


@dataclass(slots=True)
class ClientCounters:
    """One client's running totals, owned by its Dispatcher (Client.counters, ShardWatch see the same object)."""
    batches: int = 0  # request payloads sent
    result_payloads: int = 0  # result payloads received (several per batch when results come as they finish)
    streams: int = 0
    aborts_sent: int = 0
    route_calls: int = 0
    complete_calls: int = 0  # router `complete` calls (completions go in one call per loop tick)
    local_routes: int = 0  # streams placed without a router call (routing.py)
    route_retries: int = 0
    retries: int = 0  # requests sent again (overloaded, draining or dead shard)
    stream_resumes: int = 0  # of those, streams that went on from their last token (retry.py)
    restarts_seen: int = 0
    credit_waits: int = 0
    # per-batch costs, summed: decoded (raw) vs compressed payload bytes, seconds in routing calls, request
    # encoding and result decoding
    payload_raw_bytes: int = 0
    payload_wire_bytes: int = 0
    route_s: float = 0.0
    encode_s: float = 0.0
    result_decode_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class ShardBatcher:
    """One shard's queue: flushes at max_prompts, after window_s from its first request, before the
    decoded payload would pass max_payload_bytes, or when the client says a generate() call's batch is
    formed, whichever comes first. `send(shard, batch)` is awaited in its own task, so batches to one
    shard overlap."""

    def __init__(self, shard: int, send, max_prompts: int, window_s: float, max_payload_bytes: int):
        """max_prompts and window_s: ClientConfig's max_batch_prompts and batch_window_ms."""
        self.shard, self.send = shard, send
        self.max_prompts, self.window_s, self.max_payload_bytes = max_prompts, window_s, max_payload_bytes
        self.items: list[Pending] = []
        self.nbytes = BATCH_OVERHEAD
        self.timer: asyncio.TimerHandle | None = None
        self.tasks: set[asyncio.Task] = set()
        self.flushes = {"prompts": 0, "window": 0, "bytes": 0, "formed": 0}

    def add(self, p: Pending) -> None:
        assert p.wire_bytes + BATCH_OVERHEAD <= self.max_payload_bytes, "oversized requests are refused before batching"
        if self.nbytes + p.wire_bytes > self.max_payload_bytes:
            self.flush("bytes")
        self.items.append(p)
        self.nbytes += p.wire_bytes
        if len(self.items) >= self.max_prompts:
            self.flush("prompts")
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.window_s, self.flush, "window")

    def drop_abandoned(self) -> list[Pending]:
        """Take the queued requests whose callers gave up (their futures are done) out of the queue: never sent."""
        gone = [p for p in self.items if p.future.done()]
        if gone:
            self.items = [p for p in self.items if not p.future.done()]
            self.nbytes = BATCH_OVERHEAD + sum(p.wire_bytes for p in self.items)
            if not self.items and self.timer is not None:
                self.timer.cancel()
                self.timer = None
        return gone

    def flush(self, why: str) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.items, self.nbytes = self.items, [], BATCH_OVERHEAD
        if batch:
            self.flushes[why] += 1
            task = asyncio.get_running_loop().create_task(self.send(self.shard, batch))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)


class ClientCodec:
    def __init__(self, model_revision: str, zstd_level: int, counters: ClientCounters) -> None:
        self.model_revision, self.zstd_level, self.counters = model_revision, zstd_level, counters

    def encode(self, batch: list[Pending]) -> bytes:
        """The batch's payload; a request sent again goes under its attempt's id (batcher.attempt_id)."""
        t0 = time.perf_counter()
        reqs = [p.request if not p.attempts else dataclasses.replace(p.request, id=attempt_id(p)) for p in batch]
        payload = encode_requests(reqs, self.model_revision, self.zstd_level)
        c = self.counters
        c.encode_s += time.perf_counter() - t0
        c.payload_wire_bytes += len(payload)
        c.payload_raw_bytes += decoded_size(payload)  # the msgpack size, from the header
        return payload

    def decode(self, reply: bytes) -> list[Result]:
        t0 = time.perf_counter()
        results = decode_results(reply)
        self.counters.result_decode_s += time.perf_counter() - t0
        self.counters.result_payloads += 1
        return results
