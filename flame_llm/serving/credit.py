"""A client's flow-control credit per shard: it keeps at most the shard's admission capacity (in flight +
queued requests, ShardHealth.admission_capacity) unanswered there, so a burst waits here, in order, instead
of being rejected and retried. Batches' requests and streams wait in one queue per shard; held requests leave
in parts of at most a half of the credit (one answered part frees room while the other runs) and at most a
batch's prompts and payload budget. Credit comes back as results land (per result when they come as they
finish). Waiters take turns by user (FairQueue: the HTTP front door's end users, from the request's `user`
field or API key; a Python client's requests are one user): a user with hundreds waiting holds up another's
request by one turn, not by its backlog. Runs on the client's loop."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from flame_llm.fair_queue import FairQueue
from flame_llm.protocol.wire import BATCH_OVERHEAD
from flame_llm.serving.batcher import ClientCounters, Pending

CREDIT_PARTS = 2  # a shard's credit leaves in halves: one answered half frees room while the other runs


class Credit:
    def __init__(self, capacity: dict[int, int], max_batch_prompts: int, max_payload_bytes: int,
                 avoid: dict, counters: ClientCounters, send_part: Callable[[int, list[Pending]], None],
                 held_back: Callable[[int, list[Pending], list[Pending]], None], restarting: set | None = None
                 ) -> None:
        """capacity: per shard, its credit (its admission capacity). avoid, restarting: the shards routed
        around now (ShardWatch.avoid, ShardWatch.restarting). send_part(shard, part) sends requests that got their
        credit; held_back(shard, gone, again) takes those that leave unsent (abandoned; an avoided shard's, to be
        routed again)."""
        self.capacity, self.avoid, self.counters = capacity, avoid, counters
        self.restarting = restarting if restarting is not None else set()
        self.chunk = {s: max(1, c // CREDIT_PARTS) for s, c in capacity.items()}
        self.max_batch_prompts, self.max_payload_bytes = max_batch_prompts, max_payload_bytes
        self.send_part, self.held_back = send_part, held_back
        self.outstanding = dict.fromkeys(capacity, 0)
        # per shard, in turn for its credit (by user): held requests, and futures of streams waiting for a unit
        self.held: dict[int, FairQueue] = {s: FairQueue() for s in capacity}

    def hold(self, shard: int, batch: list[Pending]) -> None:
        self.held[shard].extend(batch, _user)
        self.release(shard)

    def release(self, shard: int) -> None:
        """Serve the shard's credit queue in order while it has room: held requests leave in parts, a waiting
        stream is granted its unit (a shard routed around now sends nothing: its held requests are routed
        again, its streams go on and meet the shard's state themselves)."""
        held, cap = self.held[shard], self.capacity[shard]
        avoided = shard in self.avoid or shard in self.restarting
        part, nbytes, limit = [], BATCH_OVERHEAD, min(self.chunk[shard], self.max_batch_prompts)
        again, gone = [], []
        while held:
            item = held.head()
            if not avoided and cap - self.outstanding[shard] - len(part) <= 0:
                self.counters.credit_waits += 1
                break
            if isinstance(item, asyncio.Future):  # a stream waiting for credit
                held.popleft()
                if not item.done():
                    self.outstanding[shard] += 1
                    item.set_result(None)
                continue
            if not avoided and part and (len(part) >= limit or nbytes + item.wire_bytes > self.max_payload_bytes):
                self._send(shard, part)
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
            self._send(shard, part)
        if gone or again:
            self.held_back(shard, gone, again)

    def drop_abandoned(self, shard: int) -> list[Pending]:
        """Take what its caller gave up on out of the shard's credit queue at once (it left only when credit came
        back before): the held requests whose futures are done, returned (never sent)."""
        return self.held[shard].drop(lambda x: isinstance(x, Pending) and x.future.done())

    def _send(self, shard: int, part: list[Pending]) -> None:
        self.outstanding[shard] += len(part)
        self.send_part(shard, part)

    async def take(self, shard: int, user: str = "") -> None:
        """One unit of the shard's credit for a stream, in `user`'s turn with the requests held before it."""
        if self.outstanding[shard] < self.capacity[shard] and not self.held[shard]:
            self.outstanding[shard] += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.held[shard].append(fut, user)
        self.counters.credit_waits += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled: the unit goes back
                self.give(shard)
            elif fut in self.held[shard]:  # still in turn: it leaves the queue now
                self.held[shard].remove(fut)
            raise

    def give(self, shard: int, n: int = 1) -> None:
        """n units come back (answered requests): held ones may leave."""
        self.outstanding[shard] -= n
        assert self.outstanding[shard] >= 0
        self.release(shard)


def _user(p: Pending) -> str:
    return p.request.user
