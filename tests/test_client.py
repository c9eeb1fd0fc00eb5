"""The client's per-shard queue (ShardQueue) forms batches: flushes at max prompts, at the formation window, or
before the decoded payload budget would be passed. No Ray needed: what leaves is recorded (ample credit)."""
import asyncio
import time

import numpy as np

from flame_llm.protocol.types import DEFAULT_MAX_PAYLOAD_BYTES, Request
from flame_llm.protocol.wire import BATCH_OVERHEAD, request_wire_size
from flame_llm.sampling_params import SamplingParams
from flame_llm.serving.pending import ClientCounters, Pending
from flame_llm.serving.shard_queue import ShardQueue


def _pending(loop, i, num_tokens=4):
    return Pending(Request(f"r{i}", np.zeros(num_tokens, dtype=np.uint32), SamplingParams()), [i], 1.0,
                   request_wire_size(num_tokens), loop.create_future(), shard=0)


class Recorder:
    def __init__(self):
        self.batches = []


class ShardBatcher(ShardQueue):
    """A shard's queue with credit to spare (each formed batch leaves whole), recording what leaves in `rec`."""

    def __init__(self, shard, rec, max_prompts, window_s, max_payload_bytes):
        super().__init__(1 << 20, max_prompts, window_s, max_payload_bytes, ClientCounters())
        self.shard, self.rec = shard, rec
        self.chunk = 1 << 20

    def send_part(self, part):
        self.rec.batches.append((self.shard, [p.request.id for p in part], time.perf_counter()))

    def held_back(self, gone, again):
        pass


def test_flush_at_max_prompts_without_waiting():
    async def main():
        loop = asyncio.get_running_loop()
        rec = Recorder()
        b = ShardBatcher(3, rec, max_prompts=128, window_s=10.0, max_payload_bytes=DEFAULT_MAX_PAYLOAD_BYTES)
        for i in range(300):
            b.add(_pending(loop, i))
        await asyncio.sleep(0)
        assert [len(ids) for _, ids, _ in rec.batches] == [128, 128]
        assert rec.batches[0][0] == 3 and rec.batches[0][1][:2] == ["r0", "r1"]
        assert len(b.items) == 44 and b.timer is not None  # the rest waits for its window
        b.flush("window")
        await asyncio.sleep(0)
        assert [len(ids) for _, ids, _ in rec.batches] == [128, 128, 44]
        assert b.flushes == {"prompts": 2, "window": 1, "bytes": 0, "formed": 0}

    asyncio.run(main())


def test_flush_after_formation_window():
    async def main():
        loop = asyncio.get_running_loop()
        rec = Recorder()
        b = ShardBatcher(0, rec, max_prompts=128, window_s=0.010, max_payload_bytes=DEFAULT_MAX_PAYLOAD_BYTES)
        t0 = time.perf_counter()
        for i in range(3):
            b.add(_pending(loop, i))
        await asyncio.sleep(0.003)
        b.add(_pending(loop, 3))  # joins the open window, does not restart it
        await asyncio.sleep(0.002)
        assert rec.batches == []
        await asyncio.sleep(0.030)
        assert [ids for _, ids, _ in rec.batches] == [["r0", "r1", "r2", "r3"]]
        assert 0.009 <= rec.batches[0][2] - t0 < 0.5  # loose: a loaded machine runs timers late
        b.add(_pending(loop, 4))  # a new window starts with the next request
        await asyncio.sleep(0.030)
        assert [ids for _, ids, _ in rec.batches][1] == ["r4"]

    asyncio.run(main())


def test_flush_before_decoded_budget_is_passed():
    async def main():
        loop = asyncio.get_running_loop()
        rec = Recorder()
        per = request_wire_size(1000)
        budget = BATCH_OVERHEAD + 3 * per + per // 2  # room for three 1000-token requests, not four
        b = ShardBatcher(0, rec, max_prompts=128, window_s=10.0, max_payload_bytes=budget)
        for i in range(7):
            b.add(_pending(loop, i, 1000))
        await asyncio.sleep(0)
        assert [len(ids) for _, ids, _ in rec.batches] == [3, 3]
        assert b.nbytes == BATCH_OVERHEAD + per and b.flushes["bytes"] == 2

    asyncio.run(main())
