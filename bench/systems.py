"""The systems a burst runs against, behind one small interface: start() -> info, run_burst(requests,
max_tokens) -> (release perf_counter, records), stats(), stop(); load mode adds http_replicas(). flame is here
(the service through its Python client, or its HTTP front door in load mode); engine and vllm are server
processes (bench/http_system.py); the labels and what each sets are in bench/system_config.py."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

from bench.burst.traces import TraceRequest
from bench.gpus import verify_processes, wait_gpus_idle
from bench.http_client import SERVED_MODEL_NAME, Replica
from bench.http_system import HttpSystem, free_port
from bench.system_config import Setup, SystemConfig

log = logging.getLogger(__name__)


def make_system(system: SystemConfig, setup: Setup, tag: str):
    return FlameSystem(system, setup, tag) if system.kind == "flame" else HttpSystem(system, setup, tag)


class FlameSystem:
    def __init__(self, system: SystemConfig, setup: Setup, tag: str):
        self.system, self.setup, self.tag = system, setup, tag
        self.service = self.client = self.namespace = None
        self._door: tuple | None = None  # (front door actor, its URL), when load mode opened it
        self._before: dict = {}
        self._loop = asyncio.new_event_loop()

    def start(self) -> dict:
        from flame_llm.serving.client import make_client
        from flame_llm.serving.ray_attach import init_ray
        from flame_llm.serving.service import start_service
        from flame_llm.serving.service_config import ServiceConfig

        s = self.setup
        cfg = ServiceConfig.from_kwargs(
            model=s.model, load_format=s.load_format, engine={**s.engine, **self.system.engine},
            num_shards=len(s.devices),
            cpu_shards=len(s.devices), cpu_per_shard=s.cpu_per_shard, torch_threads=s.torch_threads,
            gpu_uuids=list(s.devices) if s.on_gpu else [], policy=self.system.policy, spill_factor=s.spill_factor,
            address=s.ray_address, namespace=f"bench-{uuid.uuid4().hex[:10]}", startup_timeout_s=s.startup_timeout_s)
        init_ray(cfg)
        self.namespace = cfg.ray.namespace
        self.service = start_service(cfg)
        placed = [p.gpu_uuid or p.name for p in self.service.placements]
        if placed != s.devices:
            raise RuntimeError(f"flame placed shards on {placed}; the bench's shard -> device map is {s.devices}")
        self.client = make_client(cfg, self.service.router, self.service.actors, **self.system.client)
        health = self.service.health
        check = verify_processes(s.devices, [h.pid for h in health], False) if s.on_gpu else {}
        return {"placement": placed, "health": [h.to_dict() for h in health], "namespace": cfg.ray.namespace, **check,
                "actor_check": "each actor compares torch's cuda:0 UUID with its planned UUID at start"}

    def run_burst(self, requests: list[TraceRequest], max_tokens: int) -> tuple[float, list[dict]]:
        from flame_llm.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if any(r.max_tokens not in (0, max_tokens) for r in requests):  # the decode trace: each its own length
            sp = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens or max_tokens, ignore_eos=True)
                  for r in requests]
        prompts = [r.token_ids for r in requests]
        self._before = self._counters()  # outside the timed span: the last burst's counters are its own
        call = asyncio.wait_for(self.client.agenerate(prompts, sp), self.setup.burst_timeout_s)
        t_release = time.perf_counter()
        results = self._loop.run_until_complete(call)
        t_end = time.perf_counter()
        records = []
        for req, r in zip(requests, (r.to_dict() for r in results), strict=True):  # plus the bench's fields
            done_at = r["timings"].get("done_at")  # per-request completion, when the client reports it
            records.append({**r, "id": req.rid, "cached_reported": r["error"] is None,
                            "output_len": len(r["output_token_ids"]),
                            "done_s": (done_at - t_release) if done_at is not None else t_end - t_release,
                            "done_source": "request" if done_at is not None else "burst"})
        return t_release, records

    def http_replicas(self) -> list[Replica]:
        """The service's HTTP front door (opened on first use, on a free port of this node) as the one replica:
        load mode drives flame over HTTP like the other systems; the router places requests behind it."""
        if self._door is None:
            from flame_llm.serving.frontdoor import start_frontdoor
            from flame_llm.serving.http_app import HttpConfig

            http = HttpConfig(port=free_port(), served_model_name=SERVED_MODEL_NAME)
            import dataclasses

            from flame_llm.serving.service_config import ClientConfig

            client = dataclasses.replace(ClientConfig(), **self.system.client)
            self._door = start_frontdoor(self.namespace, http, client=client)
        return [Replica(0, self._door[1], ",".join(self.setup.devices))]

    def _counters(self) -> dict:
        import ray
        actors = ray.get([a.stats.remote() for a in self.service.actors.values()])
        keep = ("batches", "requests", "bad_batches", "decode_s", "encode_s")
        return {"client": self.client.counters.to_dict(), "actors": [{k: a[k] for k in keep} for a in actors]}

    def stats(self) -> dict:
        """Router and client state, and the last burst's service-path counters (client: routing, payload
        bytes raw vs compressed, request encode and result decode; each actor: batch decode and result
        encode), taken as after-minus-before so warmup rounds are not in them."""
        import ray
        after = self._counters()
        burst = {"client": {k: v - self._before["client"][k] for k, v in after["client"].items()},
                 "actors": [{k: v - b[k] for k, v in a.items()}
                            for a, b in zip(after["actors"], self._before["actors"], strict=True)]}
        return {"router": ray.get(self.service.router.stats.remote()), "client": after["client"], "burst": burst}

    def stop(self) -> None:
        if self._door is not None:
            from flame_llm.serving.frontdoor import stop_frontdoor

            stop_frontdoor(self.namespace)
            self._door = None
        if self.client is not None:
            self.client.close()
        if self.service is not None:
            self.service.stop()
        self._loop.close()
        if self.setup.on_gpu:
            wait_gpus_idle(self.setup.devices)
