"""Fairness among the HTTP front door's users (issue 37 item 9): the door is one client of the shards, and its users
(an API key, else the OpenAI `user`, else the address) each take their own turn in the shard's fair admission
(Request.user), not one turn for the whole door. Real local Ray, one CPU shard of the tiny model, the real door,
127.0.0.1 only, bounded in count and time."""
import json
import statistics
import threading
import time
import urllib.request

import pytest
import ray

from flame_llm.serving.frontdoor import start_frontdoor, stop_frontdoor
from flame_llm.serving.http_app import HttpConfig
from flame_llm.serving.service import start_service
from flame_llm.serving.service_config import ServiceConfig

NS = "test-door-fairness"
BURST_REQUESTS, PER_CALL = 320, 64  # the burst: five calls of 64 prompts
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def door(tiny_llama):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    # the shard's default admission bounds (1024 in flight, 4096 queued) hold the whole burst: the client's credit
    # does not, so before each user had its turn there the single requests queued behind all of it
    svc = start_service(ServiceConfig.from_kwargs(
        model=tiny_llama, num_shards=1, cpu_per_shard=0.5, namespace=NS,
        engine={"max_model_len": 256, "max_num_batched_tokens": 1024, "max_num_seqs": 16, "cpu_kvcache_gib": 0.0625},
        max_inflight_requests=16))
    handle, url = start_frontdoor(NS, HttpConfig(port=0, max_prompts_per_request=PER_CALL))
    yield url
    del handle
    stop_frontdoor(NS)
    svc.stop(timeout_s=10)
    ray.shutdown()


def _complete(url: str, prompt, user: str) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "user": user}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=240) as r:
        return json.loads(r.read())


def test_a_single_request_is_not_queued_behind_another_users_burst(door):
    url = door
    _complete(url, [7, 8, 9], "warm")
    t0 = time.perf_counter()
    _complete(url, [7, 8, 10], "single")
    alone_s = time.perf_counter() - t0
    outs: list = []
    calls = [[[3 + (k * PER_CALL + i) % 250, 4 + i % 200, 5] for i in range(PER_CALL)]
             for k in range(BURST_REQUESTS // PER_CALL)]
    threads = [threading.Thread(target=lambda c=c: outs.append(_complete(url, c, "burst"))) for c in calls]
    t_burst = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(0.3)  # the burst is queued at the shard
    singles = []
    for k in range(4):
        t0 = time.perf_counter()
        out = _complete(url, [11, 12, 13 + k], "single")
        singles.append(time.perf_counter() - t0)
        assert out["choices"][0]["finish_reason"] == "length"
    for t in threads:
        t.join(timeout=240)
    burst_s = time.perf_counter() - t_burst
    assert sum(len(o["choices"]) for o in outs) == BURST_REQUESTS  # every request completes
    assert all(c["finish_reason"] == "length" for o in outs for c in o["choices"])
    batch_s = burst_s / (BURST_REQUESTS / 16)  # the time to serve one full batch (16 sequences)
    # each single is admitted at the next free slot: within a few batch service times (before: behind the burst,
    # 3.4 s); the slowest of four may meet a slot freed late (0.69 s against 4 x 0.13 s once in a fresh-clone CI run)
    # but never the burst's own wait
    assert statistics.median(singles) < 4 * batch_s + alone_s, (singles, batch_s, burst_s)
    assert max(singles) < 0.5 * burst_s, (singles, batch_s, burst_s)
