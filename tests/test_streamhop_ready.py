"""Issue 18 item 2 (streaming hops): the client reads a streamed item that has arrived without `await ref` (one
thread hop less per chunk), falling back to awaiting it when it cannot be read at once; a front door takes its
client's configuration (and an actor name of its own, for a second door beside the service's). Real local Ray,
real tiny Llama shards."""
import asyncio
import json
import time
import urllib.request

import pytest
import ray

from flame_llm.serving.client_stream import _NOT_HERE, _ready_value
from flame_llm.serving.frontdoor import FRONTDOOR_NAME, start_frontdoor
from flame_llm.serving.http_app import HttpConfig
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ClientConfig, ServiceConfig

NS = "test-streamhop"
ENGINE = {"max_model_len": 256, "max_num_batched_tokens": 256, "max_num_seqs": 8, "cpu_kvcache_gib": 0.03125}


@ray.remote
class Items:
    @ray.method(num_returns="streaming")
    async def stream(self, n: int, fail_at: int | None = None):
        for i in range(n):
            if i == fail_at:
                raise ValueError(f"item {i} failed")
            await asyncio.sleep(0.01)
            yield [i]

    async def slow(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "late"


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_arrived_items_are_read_at_once_and_in_order(local_ray):
    items = Items.remote()

    async def main():
        got = []
        async for ref in items.stream.remote(5):
            value = _ready_value(ref)
            assert value is not _NOT_HERE  # __anext__ returned it: it has arrived
            got.append(value)
        return got

    assert asyncio.run(main()) == [[0], [1], [2], [3], [4]]


def test_a_failed_item_raises_what_awaiting_it_raises(local_ray):
    items = Items.remote()

    async def main(read):
        got = []
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            async for ref in items.stream.remote(5, fail_at=2):
                got.append(await read(ref))
        return got, e.value

    async def ready(ref):
        return _ready_value(ref)

    async def awaited(ref):
        return await ref

    (got_ready, e_ready), (got_awaited, e_awaited) = asyncio.run(main(ready)), asyncio.run(main(awaited))
    assert got_ready == got_awaited == [[0], [1]]
    assert type(e_ready.cause) is type(e_awaited.cause) is ValueError and "item 2 failed" in str(e_ready)


def test_an_item_not_here_yet_is_left_to_be_awaited(local_ray):
    """The fallback: a ref whose value has not arrived is not waited for (the caller awaits it instead)."""
    items = Items.remote()
    ref = items.slow.remote(3.0)
    t0 = time.monotonic()
    assert _ready_value(ref) is _NOT_HERE
    assert time.monotonic() - t0 < 2.0  # it did not wait for the value
    assert ray.get(ref) == "late"


def _stream_tokens(url: str, prompt: list[int]) -> list[int]:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                       "stream": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    tokens = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp:
            line = line.strip()
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens += choice.get("token_ids") or []
    return tokens


def test_a_front_door_takes_its_clients_configuration(local_ray, tiny_llama):
    """start_frontdoor(client=..., name=...): a second door beside the service's, its client configured as given
    (the service's door keeps the defaults); both stream the same greedy tokens."""
    svc = start_service(ServiceConfig.from_kwargs(model=tiny_llama, engine=ENGINE, num_shards=1, cpu_per_shard=0.5,
                                                  namespace=NS))
    try:
        http = HttpConfig(port=0, served_model_name="m")
        plain, plain_url = start_frontdoor(NS, http)
        other, other_url = start_frontdoor(NS, http, client=ClientConfig(local_routing=False, max_retries=3),
                                           name=f"{FRONTDOOR_NAME}-b")
        configs = ray.get([d.__ray_call__.remote(lambda door: door.client.config) for d in (plain, other)])
        assert configs[0] == ClientConfig()
        assert configs[1] == ClientConfig(local_routing=False, max_retries=3)
        prompt = list(range(10, 40))
        a, b = _stream_tokens(plain_url, prompt), _stream_tokens(other_url, prompt)
        assert len(a) == 8 and a == b
        for d in (plain, other):
            ray.get(d.stop.remote())
            ray.kill(d, no_restart=True)
    finally:
        svc.stop()
