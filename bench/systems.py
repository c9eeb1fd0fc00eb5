"""The systems a burst runs against, behind one small interface: start() -> info, run_burst(requests,
max_tokens) -> (release perf_counter, records), stats(), stop(); load mode adds http_replicas().

- flame: the service (router + one engine actor per device) through the Python client (bursts) or its
  HTTP front door (load mode).
- engine: one `flame_llm.serving.http_server` process per device, driven by the sticky-prefix HTTP client.
- vllm: one `vllm serve` process per device, same client; config "default" or "seed" (eager, Triton attention).
Every system uses the same device list: shard k <-> device k (GPU UUID, or cpu-k without GPUs). A label
ending in "-rr" places requests round-robin instead of by prefix (the affinity A/B); "flame-batch" is flame
with each shard batch's results returned at once (ClientConfig.results_as_finished off: the A/B of issue 18
item 1); "flame-nomix" and "engine-nomix" run steps with prefill tokens eagerly (cuda_graph_mixed_tokens 0: the
A/B of the mixed-step graphs); "flame-noprune" and "engine-noprune" run eager steps' last layer on every
row (prune_last_layer off: the A/B of issue 19's pruning, on by default); "flame-split" and "engine-split" run
eager steps' MLP gate/up GEMM as row blocks of at most 4,096 rows (mlp_row_split_tokens 4096, off by default:
issue 19's A/B of cuBLAS's kernel at 8,192 rows); "flame-raystream" streams over the
engine actors' Ray method instead of their stream servers (ClientConfig.stream_transport "ray": the transport
A/B of load mode); "flame-noresume" fails a stream whose shard dies after its first token instead of resuming it
(ClientConfig.stream_resume off: the A/B of load mode's --kill-shard-at).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field

from bench.gpus import gpu_index, verify_processes, wait_gpus_idle
from bench.http_client import SERVED_MODEL_NAME, Replica, StickyHttpClient
from bench.traces import TraceRequest

log = logging.getLogger(__name__)
KINDS = ("flame", "flame-batch", "flame-nomix", "flame-noprune", "flame-split", "flame-raystream", "flame-noresume",
         "engine", "engine-nomix", "engine-noprune", "engine-split", "vllm", "vllm-seed")
# engine fields a system label sets over the run's (the label is the A/B's one flag)
LABEL_ENGINE = {"flame-nomix": {"cuda_graph_mixed_tokens": 0}, "engine-nomix": {"cuda_graph_mixed_tokens": 0},
                "flame-noprune": {"prune_last_layer": False}, "engine-noprune": {"prune_last_layer": False},
                "flame-split": {"mlp_row_split_tokens": 4096}, "engine-split": {"mlp_row_split_tokens": 4096}}
# client fields (ClientConfig) a flame label sets: its Python client's and its front door's
LABEL_CLIENT = {"flame-batch": {"results_as_finished": False}, "flame-raystream": {"stream_transport": "ray"},
                "flame-noresume": {"stream_resume": False}}
VLLM_SEED_FLAGS = ("--enforce-eager", "--attention-backend", "TRITON_ATTN")


@dataclass(slots=True)
class SystemConfig:
    label: str  # e.g. "flame", "engine-rr", "vllm-seed"
    kind: str  # flame | engine | vllm
    vllm_config: str | None  # "default" | "seed" for vllm
    policy: str  # the router policy placing requests
    engine: dict = field(default_factory=dict)  # engine fields over the run's (LABEL_ENGINE)
    client: dict = field(default_factory=dict)  # flame: ClientConfig fields over the defaults (LABEL_CLIENT)


def parse_system(label: str, sticky_policy: str = "cumulative") -> SystemConfig:
    base, rr = (label[:-3], True) if label.endswith("-rr") else (label, False)
    if base not in KINDS:
        raise ValueError(f"system must be one of {', '.join(KINDS)}, optionally with '-rr' (round-robin "
                         f"placement); got {label!r}")
    kind = "vllm" if base.startswith("vllm") else "flame" if base.startswith("flame") else "engine"
    cfg = ("seed" if base == "vllm-seed" else "default") if kind == "vllm" else None
    return SystemConfig(label, kind, cfg, "round_robin" if rr else sticky_policy, dict(LABEL_ENGINE.get(base, {})),
                        dict(LABEL_CLIENT.get(base, {})))


@dataclass(slots=True)
class Setup:
    model: str  # absolute model dir
    model_revision: str
    devices: list[str]  # shard k's GPU UUID, or cpu-k
    engine: dict  # flame_llm Config fields shared by flame and engine (load_format excluded)
    load_format: str = "dummy"
    log_dir: str = "."
    ray_address: str | None = None
    torch_threads: int = 1  # CPU shards / CPU servers
    cpu_per_shard: float = 0.5
    startup_timeout_s: float = 900.0
    burst_timeout_s: float = 3600.0
    spill_factor: float = 1.25
    vllm_bin: str = "vllm"
    vllm_pythonpath: str = ""
    vllm_args: list[str] = field(default_factory=list)  # extra flags for every vllm serve
    gpu_memory_utilization: float = 0.9
    vllm_return_token_ids: bool = False

    @property
    def on_gpu(self) -> bool:
        return not self.devices[0].startswith("cpu-")


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
        from flame_llm.serving.service import init_ray, start_service
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


class HttpSystem:
    """engine or vllm: one server process per device, each in its own session (process group)."""

    def __init__(self, system: SystemConfig, setup: Setup, tag: str):
        self.system, self.setup, self.tag = system, setup, tag
        self.procs: list[subprocess.Popen] = []
        self.client: StickyHttpClient | None = None
        self.commands: list[list[str]] = []
        self._loop = asyncio.new_event_loop()

    def command(self, device: str, port: int) -> tuple[list[str], dict]:
        s = self.setup
        env = dict(os.environ)
        if s.on_gpu:  # our server takes the UUID (and verifies it); vLLM parses indices only: PCI order index
            env["CUDA_VISIBLE_DEVICES"] = device if self.system.kind == "engine" else str(gpu_index(device))
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if self.system.kind == "engine":
            engine = {**s.engine, **self.system.engine, "device": "cuda" if s.on_gpu else "cpu"}
            cmd = [sys.executable, "-m", "flame_llm.serving.http_server", "--model", s.model, "--port", str(port),
                   "--served-model-name", SERVED_MODEL_NAME, "--load-format", s.load_format,
                   "--engine-json", json.dumps(engine), "--torch-threads", str(s.torch_threads)]
            cmd += ["--gpu-uuid", device] if s.on_gpu else ["--device-name", device]
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
            return cmd, env
        e = s.engine
        cmd = [s.vllm_bin, "serve", s.model, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", SERVED_MODEL_NAME, "--load-format", s.load_format, "--skip-tokenizer-init",
               "--max-model-len", str(e["max_model_len"]), "--max-num-seqs", str(e["max_num_seqs"]),
               "--max-num-batched-tokens", str(e["max_num_batched_tokens"]), "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--gpu-memory-utilization", str(s.gpu_memory_utilization),
               "--seed", "0"]
        cmd += list(VLLM_SEED_FLAGS) if self.system.vllm_config == "seed" else []
        cmd += list(s.vllm_args)
        if s.vllm_pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [s.vllm_pythonpath, env.get("PYTHONPATH", "")]))
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        return cmd, env

    def start(self) -> dict:
        s = self.setup
        if s.on_gpu:
            wait_gpus_idle(s.devices)
        ports = [free_port() for _ in s.devices]
        os.makedirs(s.log_dir, exist_ok=True)
        for k, (dev, port) in enumerate(zip(s.devices, ports, strict=True)):
            cmd, env = self.command(dev, port)
            self.commands.append(cmd)
            logf = open(os.path.join(s.log_dir, f"{self.tag}-replica{k}.log"), "wb")  # noqa: SIM115
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True))
            logf.close()
        for k, port in enumerate(ports):
            self._wait_healthy(k, port)
        replicas = [Replica(k, f"http://127.0.0.1:{p}", d) for k, (p, d) in enumerate(zip(ports, s.devices,
                                                                                             strict=True))]
        self.client = StickyHttpClient(replicas, s.model_revision, self.system.policy, s.spill_factor,
                                       return_token_ids=s.vllm_return_token_ids and self.system.kind == "vllm",
                                       timeout_s=s.burst_timeout_s)
        health = self._loop.run_until_complete(self.client.open())
        check = verify_processes(s.devices, [p.pid for p in self.procs], True) if s.on_gpu else {}
        for k, h in enumerate(health):  # our server reports the device it verified through torch
            if "device" in h and h["device"] != s.devices[k]:
                raise RuntimeError(f"replica {k} reports device {h['device']}; planned {s.devices[k]}")
        return {"placement": list(s.devices), "health": health, "commands": self.commands, **check}

    def http_replicas(self) -> list[Replica]:
        """The started replicas' OpenAI endpoints (load mode drives them with its own sessions)."""
        return list(self.client.replicas)

    def _wait_healthy(self, k: int, port: int) -> None:
        deadline = time.monotonic() + self.setup.startup_timeout_s
        proc = self.procs[k]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{self.system.label} replica {k} exited with {proc.returncode} during startup; "
                                   f"log tail:\n{self._log_tail(k)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.system.label} replica {k} not healthy after {self.setup.startup_timeout_s}s; "
                           f"log tail:\n{self._log_tail(k)}")

    def _log_tail(self, k: int) -> str:
        path = os.path.join(self.setup.log_dir, f"{self.tag}-replica{k}.log")
        try:
            with open(path, "rb") as f:
                return f.read()[-3000:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def run_burst(self, requests: list[TraceRequest], max_tokens: int) -> tuple[float, list[dict]]:
        return self._loop.run_until_complete(self.client.run_burst(requests, max_tokens))

    def stats(self) -> dict:
        return {"router_policy": self.client.stats()}

    def stop(self) -> None:
        if self.client is not None:
            self._loop.run_until_complete(self.client.close())
        self._loop.close()
        for p in self.procs:
            stop_group(p)
        if self.setup.on_gpu:
            wait_gpus_idle(self.setup.devices)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM the process group this Popen leads (its own session), then SIGKILL what remains."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
    proc.wait(timeout=10)
