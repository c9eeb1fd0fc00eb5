"""Issue 18 item 2 (streaming hops): a front door takes its client's configuration (and an actor name of its own,
for a second door beside the service's). (The Ray stream path's read-at-once tests went with that path, issue 38.)
Real local Ray, real tiny Llama shards."""
import json
import urllib.request

import pytest
import ray

from flame_llm.serving.frontdoor import FRONTDOOR_NAME, start_frontdoor
from flame_llm.serving.http_app import HttpConfig
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ClientConfig, ServiceConfig

NS = "test-streamhop"
ENGINE = {"max_model_len": 256, "max_num_batched_tokens": 256, "max_num_seqs": 8, "cpu_kvcache_gib": 0.03125}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


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
        other, other_url = start_frontdoor(NS, http, client=ClientConfig(batch_window_ms=5.0, max_retries=3),
                                           name=f"{FRONTDOOR_NAME}-b")
        configs = ray.get([d.__ray_call__.remote(lambda door: door.client.config) for d in (plain, other)])
        assert configs[0] == ClientConfig()
        assert configs[1] == ClientConfig(batch_window_ms=5.0, max_retries=3)
        prompt = list(range(10, 40))
        a, b = _stream_tokens(plain_url, prompt), _stream_tokens(other_url, prompt)
        assert len(a) == 8 and a == b
        for d in (plain, other):
            ray.get(d.stop.remote())
            ray.kill(d, no_restart=True)
    finally:
        svc.stop()
