"""engine and vllm as bench systems: one HTTP server process per device (our serve-http, or `vllm serve` in its
default or the seed's configuration), each in its own session, driven by the sticky-prefix HTTP client."""
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

from bench import REPO
from bench.burst.traces import TraceRequest
from bench.gpus import gpu_index, verify_processes, wait_gpus_idle
from bench.http_client import SERVED_MODEL_NAME, Replica, StickyHttpClient
from bench.system_config import VLLM_CONFIG_FLAGS, Setup, SystemConfig

log = logging.getLogger(__name__)


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
            root = REPO
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
            return cmd, env
        e = s.engine
        cmd = [s.vllm_bin, "serve", s.model, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", SERVED_MODEL_NAME, "--load-format", s.load_format, "--skip-tokenizer-init",
               "--max-model-len", str(e["max_model_len"]), "--max-num-seqs", str(e["max_num_seqs"]),
               "--max-num-batched-tokens", str(e["max_num_batched_tokens"]), "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--gpu-memory-utilization", str(s.gpu_memory_utilization),
               "--seed", "0"]
        cmd += list(VLLM_CONFIG_FLAGS[self.system.vllm_config])
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
