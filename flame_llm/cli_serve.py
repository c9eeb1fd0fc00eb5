"""The service's lifecycle commands of `flame-llm` (serve, stop) and what every command uses to find the
service: its config, its Ray cluster and namespace."""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flame_llm.protocol.types import ShardHealth

log = logging.getLogger("flame_llm.cli")
SUPERVISE_EVERY_S = 2.0  # serve: between looks for shards whose node is gone


def config_of(args):
    """The service config of --config (default: ServiceConfig()), with --namespace, --address and --tokenizer over
    it where the command has them."""
    import dataclasses

    from flame_llm.serving.service_config import ServiceConfig, load_service_config, with_ray

    namespace, address = getattr(args, "namespace", None), getattr(args, "address", None)
    cfg = load_service_config(args.config, namespace, address) if args.config else with_ray(ServiceConfig(), namespace,
                                                                                            address)
    tokenizer = getattr(args, "tokenizer", None)
    return cfg if tokenizer is None else dataclasses.replace(cfg, tokenizer=tokenizer)


def attach_service(args) -> str:
    """Connect this process to the service's Ray cluster; returns the service's namespace (without --namespace
    or --config: the default one, or the one namespace that runs a service)."""
    from flame_llm.serving.ray_attach import attach, resolve_namespace

    cfg = config_of(args)
    attach(cfg.ray.namespace, cfg.ray.address or "auto")
    explicit = getattr(args, "namespace", None) is not None or getattr(args, "config", None)
    return resolve_namespace(cfg.ray.namespace if explicit else None)


def print_placement(health: list[ShardHealth]) -> None:
    print(f"{'shard':>5}  {'name':<6}  {'device':<40}  node")
    for h in health:
        print(f"{h.shard:>5}  {h.name:<6}  {h.device:<40}  {h.node}")


def serve(args) -> int:
    import dataclasses

    import ray

    from flame_llm.serving.frontdoor import start_frontdoor, stop_frontdoor
    from flame_llm.serving.http_auth import Keys, key_from_env
    from flame_llm.serving.service import start_service

    cfg = config_of(args)
    http = dataclasses.replace(cfg.http, **{k: v for k, v in (("host", args.host), ("port", args.http_port),
                                                               ("api_key", args.api_key),
                                                               ("api_key_file", args.api_key_file)) if v is not None})
    http = dataclasses.replace(http, api_key=key_from_env(http.api_key, http.api_key_file))
    if http.enabled:
        Keys(http.api_key, http.api_key_file)  # a key file that cannot be read: the error, before anything starts
    if args.no_http:
        http = dataclasses.replace(http, enabled=False)
    if args.detach and cfg.ray.address is None:
        raise SystemExit("serve --detach needs ray.address (a local Ray started here ends with this process)")
    started_ray = not ray.is_initialized() and cfg.ray.address is None
    svc = start_service(cfg, detached=args.detach, source=args.config or "the default config")
    lifetime = "detached" if args.detach else None
    try:  # the handle is kept: a non-detached actor ends when its last handle goes
        door, address = (start_frontdoor(cfg.ray.namespace, http, lifetime, client=cfg.client) if http.enabled
                         else (None, None))
    except RuntimeError:
        svc.stop(timeout_s=10)
        raise
    print(f"flame-llm service in namespace {cfg.ray.namespace!r}: {len(svc.actors)} shards, "
          f"router policy {cfg.router.policy}; ray address: {ray.get_runtime_context().gcs_address}")
    print_placement(svc.health)
    if address:
        keyed = "; bearer token required" if http.api_key or http.api_key_file else ""
        print(f"listening on {address} (OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
              f"/detokenize, /health, /metrics{keyed})")
    if os.environ.get("RAY_AUTH_MODE") == "token":  # Ray turned token auth on for the cluster it started
        print("other processes connect with RAY_AUTH_MODE=token set (Ray's token file is ~/.ray/auth_token; "
              "flame-llm sets it when that file exists)")
    if args.detach:
        return 0
    print("serving; Ctrl-C or flame-llm stop ends it", flush=True)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    next_look = time.monotonic() + SUPERVISE_EVERY_S
    try:
        while not stopping:
            time.sleep(0.5)
            if not svc.running():
                print("the service was stopped (flame-llm stop); exiting", flush=True)
                break
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + SUPERVISE_EVERY_S
                try:
                    svc.supervise()  # shards whose node is gone, and shards that are wedged
                except Exception as e:  # noqa: BLE001 - try again next round
                    log.warning("supervising the shards failed: %s", e)
    except KeyboardInterrupt:
        pass
    finally:
        if svc.running():
            stop_frontdoor(cfg.ray.namespace)
            svc.stop()
        del door
        if started_ray:
            ray.shutdown()  # the local Ray this process started ends with it
    return 0


def stop(args) -> int:
    from flame_llm.serving.frontdoor import stop_frontdoor
    from flame_llm.serving.service import stop as stop_service

    namespace = attach_service(args)
    door = stop_frontdoor(namespace)
    print(f"stopped {stop_service(namespace)} engine actors{' and the front door' if door else ''} in namespace "
          f"{namespace!r}; the flame-llm serve that started them exits")
    return 0
