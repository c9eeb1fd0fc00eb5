"""`flame-llm` command line: the service's commands. A subcommand is one function `name(args) -> int`
plus one line in COMMANDS naming its help and arguments (from ARGS, or inline). The installed
`flame-llm` is bench.cli, which adds the benchmark commands on top of these (bench depends on this
app, never the reverse)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from flame_llm.serving.http_server import ARGUMENTS as SERVE_HTTP_ARGS
from flame_llm.serving.service_config import DEFAULT_NAMESPACE

log = logging.getLogger("flame_llm.cli")

DEMO_CONFIG = {"model": "tiny", "engine": {"max_model_len": 1024, "max_num_batched_tokens": 1024, "max_num_seqs": 16,
                                            "cpu_kvcache_gib": 0.0625},
               "placement": {"num_shards": 2, "cpu_per_shard": 0.5}, "shard": {"torch_threads": 1},
               "router": {"policy": "cumulative"}, "ray": {"num_cpus": 2, "namespace": "flame-demo"}}

ARGS = {
    "config": (("--config",), {"help": "service YAML (configs/service.yaml)"}),
    "namespace": (("--namespace",), {"help": "Ray namespace of the service (default: the config's, or "
                                             f"{DEFAULT_NAMESPACE})"}),
    "address": (("--address",), {"help": "Ray address (default: the config's, or auto)"}),
    "json": (("--json",), {"action": "store_true", "help": "print JSON instead of a table"}),
}


def _config(args):
    from flame_llm.serving.service_config import ServiceConfig, load_service_config, with_ray

    namespace, address = getattr(args, "namespace", None), getattr(args, "address", None)
    if args.config:
        return load_service_config(args.config, namespace, address)
    return with_ray(ServiceConfig(), namespace, address)


def _attach(args) -> str:
    """Connect this process to the service's Ray cluster; returns the namespace."""
    import ray

    cfg = _config(args)
    if not ray.is_initialized():
        ray.init(address=cfg.ray.address or "auto", namespace=cfg.ray.namespace, logging_level=logging.WARNING,
                 log_to_driver=False)
    return cfg.ray.namespace


def _print_placement(health: list[dict]) -> None:
    print(f"{'shard':>5}  {'name':<6}  {'device':<40}  node")
    for h in health:
        print(f"{h['shard']:>5}  {h['name']:<6}  {h['device']:<40}  {h['node']}")


def serve(args) -> int:
    from flame_llm.serving.service import start_service

    cfg = _config(args)
    if args.detach and cfg.ray.address is None:
        raise SystemExit("serve --detach needs ray.address (a local Ray started here ends with this process)")
    svc = start_service(cfg, detached=args.detach)
    import ray

    print(f"flame-llm service in namespace {cfg.ray.namespace!r}: {len(svc.actors)} shards, "
          f"router policy {cfg.router.policy}; ray address: {ray.get_runtime_context().gcs_address}")
    _print_placement(svc.health)
    if os.environ.get("RAY_AUTH_MODE") == "token":  # Ray turned token auth on for the cluster it started
        print("other processes connect with RAY_AUTH_MODE=token set (Ray's token file is ~/.ray/auth_token)")
    if args.detach:
        return 0
    print("serving; Ctrl-C stops", flush=True)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        while not stopping:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    svc.stop()
    return 0


def submit(args) -> int:
    import numpy as np

    from flame_llm.sampling_params import SamplingParams
    from flame_llm.serving.client import Client

    namespace = _attach(args)
    if args.prompts:
        with open(args.prompts) as f:
            prompts = [json.loads(line) for line in f if line.strip()]
    else:
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(3, args.vocab, size=args.prompt_len).tolist() for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                        ignore_eos=args.ignore_eos)
    client = Client.connect(namespace)
    t0 = time.perf_counter()
    results = client.generate(prompts, sp, use_tqdm=len(prompts) > 64)
    elapsed = time.perf_counter() - t0
    client.close()
    if args.output:
        with open(args.output, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    _print_results(results, elapsed)
    return 1 if any(r["error"] for r in results) else 0


def _print_results(results: list[dict], elapsed: float) -> None:
    print(f"{'request':<12} {'shard':>5}  {'device':<12} {'node':<10} {'prompt':>6} {'cached':>6}  output")
    for r in results:
        if r["error"]:
            out = f"ERROR {r['error']['code']}: {r['error']['message']}"
        else:
            ids = r["output_token_ids"]
            out = f"{ids[:8]}{' ...' if len(ids) > 8 else ''} ({r['finish_reason']})"
        print(f"{r['id'][-12:]:<12} {r['shard']:>5}  {r['device'][:12]:<12} {r['node'][:8]:<10} "
              f"{r['prompt_tokens']:>6} {r['cached_tokens']:>6}  {out}")
    ok = [r for r in results if not r["error"]]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    print(f"{len(ok)}/{len(results)} ok in {elapsed:.2f}s; prompt tokens {prompt}, cached {cached} "
          f"({100.0 * cached / max(prompt, 1):.1f}%)")


def status(args) -> int:
    from flame_llm.serving.service import status as service_status

    st = service_status(_attach(args))
    if args.json:
        print(json.dumps(st, indent=2, default=str))
        return 0
    router = st["router"]
    print(f"namespace {st['namespace']}: router policy {router['policy']}, {router['entries']} prefixes, "
          f"counters {router['counters']}")
    routed = {s["shard"]: s for s in router["shards"]}
    print(f"{'shard':>5}  {'name':<6}  {'device':<40}  {'node':<10} {'inflight':>8} {'queued':>6} "
          f"{'rejected':>8} {'requests':>8} {'hit rate':>8}  outstanding work")
    for s in st["shards"]:
        if "error" in s:
            print(f"{s['shard']:>5}  unavailable: {s['error']}")
            continue
        hit = s["cached_tokens"] / max(s["prompt_tokens"], 1)
        print(f"{s['shard']:>5}  {s['name']:<6}  {s['device']:<40}  {s['node'][:8]:<10} "
              f"{s['inflight_requests']:>8} {s['queued']:>6} {s['rejected']:>8} {s['requests']:>8} "
              f"{100 * hit:>7.1f}%  {routed.get(s['shard'], {}).get('outstanding_work', 0.0):.0f}")
    return 0


def stop(args) -> int:
    from flame_llm.serving.service import stop as stop_service

    print(f"stopped {stop_service(_attach(args))} engine actors")
    return 0


def demo(args) -> int:
    """Local Ray, two CPU shards of the tiny default model, one batch: two documents x four questions."""
    import numpy as np
    import ray

    from flame_llm.sampling_params import SamplingParams
    from flame_llm.serving.client import start_local
    from flame_llm.serving.service_config import config_from_dict, load_service_config

    cfg = load_service_config(args.config) if args.config else config_from_dict(dict(DEMO_CONFIG), "demo")
    print(f"starting local Ray with {cfg.placement.num_shards} CPU shards of model {cfg.model!r} ...", flush=True)
    client = start_local(cfg)
    try:
        _print_placement(client.service.health)
        rng = np.random.default_rng(0)
        docs = [rng.integers(3, 512, size=300).tolist() for _ in range(2)]
        prompts = [doc + rng.integers(3, 512, size=12).tolist() for doc in docs for _ in range(4)]
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        t0 = time.perf_counter()
        results = client.generate(prompts, sp)
        _print_results(results, time.perf_counter() - t0)
    finally:
        client.close()
        ray.shutdown()
    return 1 if any(r["error"] for r in results) else 0


def serve_http(args) -> int:
    from flame_llm.serving.http_server import serve as serve_engine_http
    return serve_engine_http(args)


# name: (function, help, arguments)
COMMANDS = {
    "serve": (serve, "start or join Ray, create the router and one engine actor per GPU",
              ["config", (("--detach",), {"action": "store_true", "help": "return once up (needs ray.address)"})]),
    "submit": (submit, "submit prompts (a JSONL file of token-id lists or strings, or random ones)",
               ["config", "namespace", "address",
                (("--prompts",), {"help": "JSONL file, one prompt per line"}),
                (("--num-prompts",), {"type": int, "default": 8}),
                (("--prompt-len",), {"type": int, "default": 64}),
                (("--vocab",), {"type": int, "default": 512, "help": "random prompts draw ids below this"}),
                (("--max-tokens",), {"type": int, "default": 16}),
                (("--temperature",), {"type": float, "default": 0.0}),
                (("--seed",), {"type": int, "default": 0}),
                (("--ignore-eos",), {"action": "store_true"}),
                (("--output",), {"help": "write result records here (JSONL)"})]),
    "status": (status, "shards, GPU UUIDs, nodes, queue depths, hit rates", ["config", "namespace", "address", "json"]),
    "stop": (stop, "stop the service's engine actors and router", ["config", "namespace", "address"]),
    "demo": (demo, "local Ray, two CPU shards, the tiny default model: one batch, results and placement",
             [(("--config",), {"help": "service YAML instead of the built-in demo config"}),
              (("--max-tokens",), {"type": int, "default": 8})]),
    "serve-http": (serve_http, "our engine alone as an OpenAI-style HTTP server (token-id prompts)", SERVE_HTTP_ARGS),
}


def build_parser(commands: dict | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flame-llm", description="flame-llm: distributed LLM inference on Ray")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (fn, help_text, arguments) in (commands or COMMANDS).items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        for arg in arguments:
            flags, kwargs = ARGS[arg] if isinstance(arg, str) else arg
            p.add_argument(*flags, **kwargs)
        p.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None, commands: dict | None = None) -> int:
    """Run one subcommand of `commands` (default: this module's)."""
    args = build_parser(commands).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as e:  # OSError: missing files, unreachable Ray
        print(f"flame-llm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
