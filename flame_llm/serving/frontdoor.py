"""The service's HTTP front door: a Ray actor (named FRONTDOOR_NAME in the service's namespace, held to the
node that started it) serving the OpenAI API (flame_llm/serving/http_app.py) over a Client, so every HTTP
request takes the Python client's path: router -> per-shard channel -> msgpack+zstd -> the engine actor's
admission. It has no other way to the engines. /metrics renders the whole service's figures (every shard's,
the router's, this client's, and the front door's own latencies)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from flame_llm.models.tokenizer import load_tokenizer
from flame_llm.protocol.types import Result
from flame_llm.serving.http_app import HttpConfig
from flame_llm.serving.pending import CheckedPrompt
from flame_llm.serving.service_config import ClientConfig

log = logging.getLogger(__name__)
FRONTDOOR_NAME = "flame-frontdoor"
HEALTH_TIMEOUT_S = 5.0


class ClientBackend:
    """The http_app backend over a Client (flame_llm.serving.client)."""

    def __init__(self, client, served_model_name: str | None = None) -> None:
        from prometheus_client import CollectorRegistry, Histogram

        from actors.metrics import LATENCY_BUCKETS_S

        self.client, self.limits = client, client.limits
        # the model's tokenizer (the shards' `tokenizer` field), or None: token-id prompts only
        self.tokenizer = load_tokenizer(client.model_dir, client.tokenizer_field, client.limits.vocab_size,
                                        required=False)
        name = served_model_name or os.path.basename(os.path.normpath(client.model_dir))
        self.model_names = (name, client.model_dir)
        self.registry = CollectorRegistry()
        self.hist = {k: Histogram(f"flame_http_{k.removesuffix('_s')}_seconds", doc, registry=self.registry,
                                  buckets=LATENCY_BUCKETS_S)
                     for k, doc in (("ttft_s", "HTTP request arrival to its first streamed token"),
                                    ("e2e_s", "HTTP request arrival to its response's end"))}

    def observe(self, name: str, seconds: float) -> None:
        self.hist[name].observe(seconds)

    async def generate(self, prompts: list, sampling: list, user: str = "") -> list[Result]:
        """prompts: parse's (checked against the client's limits there: the client does not check them again)."""
        return await self.client.agenerate([CheckedPrompt(p) for p in prompts], sampling, user=user)

    def stream(self, prompt, sp, user: str = ""):
        """user: the end user whose turn the request takes at a busy shard's credit (ApiRequest.user)."""
        return self.client.stream_chunks(CheckedPrompt(prompt), sp, user)

    async def health(self) -> dict:
        """Every shard's health() and live() at once (a probe target: no stats, no actor lookups); a shard that does
        not answer within HEALTH_TIMEOUT_S, drains, or whose serving loop is wedged (`live` runs a no-op on it,
        actors/liveness.py; `health` answers from the control loop even then) counts as down."""
        async def one(actor) -> bool:
            try:
                h, live = await asyncio.wait_for(
                    asyncio.gather(actor.health.remote(), actor.live.remote(HEALTH_TIMEOUT_S / 2)), HEALTH_TIMEOUT_S)
                return not h.draining and live.ok
            except Exception:  # noqa: BLE001 - dead, restarting or slow: not up
                return False

        actors = list(self.client.actors.values())
        up = sum(await asyncio.gather(*(one(a) for a in actors)))
        info = {"status": "ok" if up else "unavailable", "model": self.model_names[1],
                "model_name": self.model_names[0], "namespace": self.client.namespace,
                "shards": len(actors), "shards_up": up, **self.limits.to_dict()}
        if not up:
            info["message"] = "no shard answers"
        return info

    async def metrics(self) -> bytes:
        from flame_llm.serving.metrics import render_service
        from flame_llm.serving.service import status

        st = await asyncio.to_thread(status, self.client.namespace)
        return render_service(st, self.client.counters.to_dict(), self.registry)


class FrontDoor:
    """Created by start_frontdoor; `start` opens the port on the actor's event loop."""

    def __init__(self, namespace: str, http: HttpConfig, client: ClientConfig | None = None) -> None:
        self.namespace, self.http, self.client, self.runner, self.address = namespace, http, None, None, ""
        self.config = client  # its client's (None: the defaults)

    def _connect(self, loop: asyncio.AbstractEventLoop):
        from flame_llm.serving.client import make_client
        from flame_llm.serving.ray_attach import find_service

        router, actors = find_service(self.namespace)
        # the client runs on this actor's loop, the HTTP server's: a stream's chunks reach the response with no
        # hand-off between threads
        fields = dataclasses.asdict(self.config) if self.config is not None else {}
        self.client = make_client(None, router, actors, namespace=self.namespace, loop=loop, **fields)
        return ClientBackend(self.client, self.http.served_model_name)

    async def start(self) -> str:
        from flame_llm.serving.http_app import build_app, start

        # blocking Ray calls stay off the actor's loop
        backend = await asyncio.to_thread(self._connect, asyncio.get_running_loop())
        self.runner, self.address = await start(build_app(backend, self.http, backend.observe), self.http)
        log.info("front door listening on %s", self.address)
        return self.address

    def client_config(self) -> ClientConfig | None:
        """The configuration its client runs with (None before start): the service config's `client` section."""
        return self.client.config if self.client is not None else None

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        if self.client is not None:
            await self.client.aclose()


def start_frontdoor(namespace: str, http: HttpConfig, lifetime: str | None = None,
                    client: ClientConfig | None = None, name: str = FRONTDOOR_NAME) -> tuple[ray.actor.ActorHandle,
                                                                                             str]:
    """The front door actor of the service in `namespace`, on this node (it binds http.host here); (handle,
    "http://host:port"). Keep the handle: unless detached, the actor ends with its last handle. RuntimeError in
    one line when the port cannot be opened. client: its client's configuration (None: the defaults); name: its
    actor's (a second door beside the service's, as bench/service/hops.py opens for an A/B)."""
    node = ray.get_runtime_context().get_node_id()
    handle = ray.remote(num_cpus=0)(FrontDoor).options(
        name=name, namespace=namespace, lifetime=lifetime,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(namespace, http, client)
    try:
        address = ray.get(handle.start.remote())
    except ray.exceptions.RayTaskError as e:
        ray.kill(handle, no_restart=True)
        cause = e.cause if isinstance(e.cause, RuntimeError) else e
        raise RuntimeError(str(cause).splitlines()[0] if isinstance(cause, RuntimeError) else str(e)) from None
    return handle, address


def stop_frontdoor(namespace: str, timeout_s: float = 10.0) -> bool:
    """Close the front door of `namespace` when it has one; True when there was one."""
    try:
        handle = ray.get_actor(FRONTDOOR_NAME, namespace=namespace)
    except ValueError:
        return False
    try:
        ray.get(handle.stop.remote(), timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - it is killed next anyway
        log.warning("front door stop failed: %s", e)
    ray.kill(handle, no_restart=True)
    return True
