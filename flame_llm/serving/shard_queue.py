"""One shard's queue at the client: the batch being formed, and the requests held for the shard's flow-control credit.

Forming: a batch leaves its window when it reaches max_prompts, its window (batch_window_ms) runs out, the next
request would pass the decoded payload budget, or the client says the batch is formed (a generate call's).

Credit: a shard admits at most its admission capacity (ShardHealth.admission_capacity) of one caller's requests
without a rejection, so the client keeps at most that many unanswered there (`outstanding`); the rest wait here and
leave in parts (half the capacity, max_batch_prompts, the payload budget) as answers come back. Requests and
streams wait in turns by user (FairQueue: the front door's end users, from the request's `user` field or API key;
a Python client's requests are one user): a user with hundreds waiting holds up another's request by one turn, not
by its backlog. What leaves is the subclass's (ShardChannel, channel.py): `send_part(part)` sends a part, and
`held_back(gone, again)` takes held requests that leave unsent: abandoned ones, and those of a shard routed around.
Runs on the client's loop."""
from __future__ import annotations

import asyncio

from flame_llm.fair_queue import FairQueue
from flame_llm.protocol.wire import BATCH_OVERHEAD
from flame_llm.serving.pending import ClientCounters, Pending

CREDIT_PARTS = 2  # a shard's credit leaves in halves: one answered half frees room while the other runs


class ShardQueue:
    def __init__(self, capacity: int, max_prompts: int, window_s: float, max_payload_bytes: int,
                 counters: ClientCounters) -> None:
        """capacity: the shard's credit (its admission capacity); max_prompts and window_s: ClientConfig's
        max_batch_prompts and batch_window_ms."""
        self.capacity, self.chunk, self.counters = capacity, max(1, capacity // CREDIT_PARTS), counters
        self.max_prompts, self.window_s, self.max_payload_bytes = max_prompts, window_s, max_payload_bytes
        self.items: list[Pending] = []  # the batch being formed
        self.nbytes = BATCH_OVERHEAD
        self.timer: asyncio.TimerHandle | None = None
        self.flushes = {"prompts": 0, "window": 0, "bytes": 0, "formed": 0}
        self.outstanding = 0  # sent (or granted to a stream) and not yet answered
        self.held = FairQueue()  # in turn for credit, by user: held requests, and futures of streams waiting

    def avoided(self) -> bool:
        """The shard is routed around now: its held requests are routed again, nothing is sent (the channel's)."""
        return False

    # --- forming ---

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

    def flush(self, why: str) -> None:
        """The batch being formed is formed: it waits for credit (leaves at once when there is room)."""
        batch = self._take_items()
        if batch:
            self.flushes[why] += 1
            self.held.extend(batch, lambda p: p.request.user)
            self.release()

    def drop_abandoned(self) -> list[Pending]:
        """Take the requests whose callers gave up (their futures are done) out of the queue: never sent."""
        gone = [p for p in self.items if p.future.done()]
        if gone:
            self.items = [p for p in self.items if not p.future.done()]
            self.nbytes = BATCH_OVERHEAD + sum(p.wire_bytes for p in self.items)
            if not self.items:  # nothing left to form: the window's timer stops
                self._take_items()
        return gone + self.held.drop(lambda x: isinstance(x, Pending) and x.future.done())

    def take_all(self) -> list[Pending]:
        """Everything queued, taken out (the client closes): the requests returned, the streams' waits cancelled."""
        out = self._take_items()
        for item in self.held:
            if isinstance(item, asyncio.Future):
                item.cancel()
            else:
                out.append(item)
        self.held.clear()
        return out

    def _take_items(self) -> list[Pending]:
        """The batch being formed, taken out; its window's timer stopped."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        items, self.items, self.nbytes = self.items, [], BATCH_OVERHEAD
        return items

    # --- credit ---

    def release(self) -> None:
        """Serve the credit queue in order while the shard has room: held requests leave in parts, a waiting stream
        is granted its unit (a shard routed around sends nothing: its held requests are routed again, its streams go
        on and meet the shard's state themselves)."""
        held, avoided = self.held, self.avoided()
        part, nbytes, limit = [], BATCH_OVERHEAD, min(self.chunk, self.max_prompts)
        again, gone = [], []
        while held:
            item = held.head()
            if not avoided and self.capacity - self.outstanding - len(part) <= 0:
                self.counters.credit_waits += 1
                break
            if isinstance(item, asyncio.Future):  # a stream waiting for credit
                held.popleft()
                if not item.done():
                    self.outstanding += 1
                    item.set_result(None)
                continue
            if not avoided and part and (len(part) >= limit or nbytes + item.wire_bytes > self.max_payload_bytes):
                self._send(part)
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
            self._send(part)
        if gone or again:
            self.held_back(gone, again)

    def _send(self, part: list[Pending]) -> None:
        self.outstanding += len(part)
        self.send_part(part)

    async def take(self, user: str = "") -> None:
        """One unit of credit for a stream, in `user`'s turn with the requests held before it."""
        if self.outstanding < self.capacity and not self.held:
            self.outstanding += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.held.append(fut, user)
        self.counters.credit_waits += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled: the unit goes back
                self.give()
            elif fut in self.held:  # still in turn: it leaves the queue now
                self.held.remove(fut)
            raise

    def give(self, n: int = 1) -> None:
        """n units come back (answered requests): held ones may leave."""
        self.outstanding -= n
        assert self.outstanding >= 0
        self.release()
