"""The client's credit queue takes waiters in turns by user (FairQueue), so one user's backlog holds up another
user's request by a turn, not by the backlog (issue 18 item 4, for the front door's end users)."""
import asyncio

import pytest

from flame_llm.fair_queue import FairQueue
from flame_llm.protocol.types import Request
from flame_llm.sampling_params import SamplingParams
from flame_llm.serving.pending import ClientCounters, Pending
from flame_llm.serving.shard_queue import ShardQueue


def test_fair_queue_serves_users_in_rotation():
    q = FairQueue()
    for i in range(4):
        q.append(f"a{i}", "a")
    q.append("b0", "b")
    q.append("a4", "a")
    q.append("c0", "c")
    assert len(q) == 7 and "b0" in q and q.head() == "a0"
    order = [q.popleft() for _ in range(7)]
    assert order == ["a0", "b0", "c0", "a1", "a2", "a3", "a4"]
    assert not q


def test_fair_queue_remove_and_drop_keep_the_others_turns():
    q = FairQueue()
    q.extend(["a0", "a1"], lambda x: x[0])
    q.extend(["b0", "b1"], lambda x: x[0])
    q.remove("a0")
    assert q.drop(lambda x: x == "b0") == ["b0"]
    assert list(q) == ["a1", "b1"]
    q.remove("a1")
    assert q.popleft() == "b1" and not q
    with pytest.raises(ValueError):
        q.remove("zz")


def _pending(loop, user: str) -> Pending:
    return Pending(Request("r", [1], SamplingParams(), user), [], 1.0, 100, loop.create_future(), shard=0)


class Recorded(ShardQueue):
    """A shard's queue whose parts are recorded (their users), not sent."""

    def __init__(self, sent: list) -> None:
        super().__init__(2, max_prompts=8, window_s=10.0, max_payload_bytes=1 << 20, counters=ClientCounters())
        self.sent = sent

    def send_part(self, part):
        self.sent.append([p.request.user for p in part])

    def held_back(self, gone, again):
        pass

    def hold(self, batch):
        for p in batch:
            self.add(p)
        self.flush("formed")


def _credit(sent: list) -> Recorded:
    return Recorded(sent)


@pytest.mark.parametrize("same_user", [False, True])
def test_a_second_users_stream_waits_one_turn_behind_a_backlog(same_user):
    """Capacity 2, one user's 10 requests held: another user's stream gets credit at the second unit that comes
    back (one turn). The same user's stream (one user, as before users existed) waits behind the whole backlog."""
    async def main() -> int:
        loop = asyncio.get_running_loop()
        sent: list = []
        credit = _credit(sent)
        credit.hold([_pending(loop, "a") for _ in range(10)])
        assert sum(map(len, sent)) == 2  # the credit is full
        task = asyncio.ensure_future(credit.take("a" if same_user else "b"))
        await asyncio.sleep(0)
        gives = 0
        while not task.done():
            credit.give()
            gives += 1
            await asyncio.sleep(0)
            assert gives <= 10
        assert task.exception() is None  # granted
        return gives

    gives = asyncio.run(main())
    assert gives == (9 if same_user else 2)


def test_abandoned_held_requests_leave_without_losing_their_users_turns():
    async def main():
        loop = asyncio.get_running_loop()
        sent: list = []
        credit = _credit(sent)
        a = [_pending(loop, "a") for _ in range(5)]
        b = [_pending(loop, "b") for _ in range(2)]
        credit.hold(a)
        credit.hold(b)
        for p in a[2:4]:
            p.future.cancel()
        assert credit.drop_abandoned() == a[2:4]
        sent.clear()
        credit.give(2)
        credit.give(2)
        return [u for part in sent for u in part]

    assert asyncio.run(main()) == ["a", "b", "b"]  # a4, then b0 (turns alternate), then b1


@pytest.fixture(scope="module")
def one_shard(tiny_llama):
    import ray

    from flame_llm.serving.service import start_service
    from flame_llm.serving.service_config import ServiceConfig

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = ServiceConfig.from_kwargs(model=tiny_llama, num_shards=1, cpu_per_shard=0.5, namespace="test-fair-users",
                                    engine={"max_model_len": 512, "max_num_batched_tokens": 512, "max_num_seqs": 4,
                                            "cpu_kvcache_gib": 0.0625},
                                    max_inflight_requests=4, max_queued_requests=4)
    svc = start_service(cfg)
    yield svc
    svc.stop(timeout_s=10)
    ray.shutdown()


def test_a_users_stream_is_served_ahead_of_another_users_backlog(one_shard):
    """One user's 40 requests wait at the client for a shard with room for 8; a stream of another user starts
    behind them and ends before most of them (it waits a turn); the same stream as the backlog's own user waits
    behind the whole backlog, as every stream did before users took turns."""
    import time

    import numpy as np

    from flame_llm import SamplingParams
    from flame_llm.serving.client import Client

    client = Client.for_service(one_shard)
    rng = np.random.default_rng(0)
    bulk = [rng.integers(3, 500, size=24).tolist() for _ in range(40)]
    long, short = (SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 2))

    async def run(stream_user: str) -> int:
        d = client.dispatch
        task = asyncio.ensure_future(client.agenerate(bulk, long, user="bulk"))
        deadline = time.monotonic() + 60
        while len(d.channels[0].held) < 16:  # a backlog of the bulk user's requests waits for credit
            assert time.monotonic() < deadline and not task.done(), "no backlog formed"
            await asyncio.sleep(0.002)
        chunks = [c async for c in client.stream_chunks(rng.integers(3, 500, size=8).tolist(), short, stream_user)]
        done_at = time.perf_counter()
        assert chunks[-1].result is not None and chunks[-1].result.error is None
        results = await task
        assert [r.error for r in results] == [None] * len(bulk)
        return sum(r.timings["done_at"] < done_at for r in results)

    try:
        fair = asyncio.run_coroutine_threadsafe(run("bob"), client._loop).result(timeout=300)
        same = asyncio.run_coroutine_threadsafe(run("bulk"), client._loop).result(timeout=300)
    finally:
        client.close()
    # bob: the 8 the shard held, plus a turn's part; the bulk user's own stream: behind (nearly) all 40
    assert fair <= 20 and same >= 32, (fair, same)
