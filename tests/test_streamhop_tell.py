"""Issue 18 item 2 (streaming hops): a stream the client placed itself is told to the
router TELL_AFTER_S after its first token, off the token's way to the caller, and exactly once: by the timer
while the stream runs, or before its completion when it ends first. Real local Ray, a one-shard service of the
tiny Llama (every stream is placed by the client there)."""
import asyncio
import time

import pytest
import ray

from flame_llm import SamplingParams
from flame_llm.serving import channel
from flame_llm.serving.client import make_client
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ServiceConfig

ENGINE = {"max_model_len": 512, "max_num_batched_tokens": 512, "max_num_seqs": 8, "cpu_kvcache_gib": 0.03125}


@pytest.fixture(scope="module")
def service(tiny_llama):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    svc = start_service(ServiceConfig.from_kwargs(model=tiny_llama, engine=ENGINE, num_shards=1, cpu_per_shard=0.5,
                                                  namespace="test-streamhop-tell"))
    client = make_client(svc.cfg, svc.router, svc.actors)
    yield svc, client
    client.close()
    svc.stop()
    ray.shutdown()


def _work(svc) -> float:
    return sum(s["outstanding_work"] for s in ray.get(svc.router.stats.remote())["shards"])


def _wait_router_idle(svc, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _work(svc) > 0:
        assert time.monotonic() < deadline, ray.get(svc.router.stats.remote())["shards"]
        time.sleep(0.05)


def test_the_router_hears_of_a_running_stream_after_its_first_token(service):
    svc, client = service
    sp = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    seen: list[float] = []

    async def main():
        first = asyncio.Event()

        async def read():
            chunks = []
            async for c in client.stream_chunks(list(range(20, 60)), sp):
                chunks.append(c)
                first.set()
            return chunks

        reading = asyncio.create_task(read())
        await first.wait()
        deadline = time.monotonic() + 5.0
        while not reading.done() and time.monotonic() < deadline:
            seen.append(await asyncio.to_thread(_work, svc))
            if seen[-1] > 0:
                break
            await asyncio.sleep(0.01)
        running = not reading.done()
        return await reading, running

    chunks, running = asyncio.run(main())
    assert chunks[-1].result.error is None and len(chunks[-1].result.output_token_ids) == 300
    assert running and seen[-1] > 0, seen  # told while the stream ran, not only at its end
    _wait_router_idle(svc)  # and its completion took the work back


def test_a_stream_ending_before_the_timer_is_told_once(service, monkeypatch):
    """The stream ends before TELL_AFTER_S: the channel tells the router before the completion, and the timer,
    firing later, tells nothing (a second tell would leave its work at the router for good)."""
    svc, client = service
    monkeypatch.setattr(channel, "TELL_AFTER_S", 1.0)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def main():
        return [c async for c in client.stream_chunks(list(range(100, 140)), sp)]

    chunks = asyncio.run(main())
    assert chunks[-1].result.error is None and len(chunks[-1].result.output_token_ids) == 4
    time.sleep(1.5)  # the timer has fired
    _wait_router_idle(svc, 2.0)
    assert _work(svc) == 0
