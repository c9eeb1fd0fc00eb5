"""`flame-llm` command line (the installed `flame-llm` is this module's main): the service's commands. A subcommand
is one function `name(args) -> int` plus one line in COMMANDS naming its help and arguments (from ARGS, or inline)
and optionally an epilog. Other installed packages add commands through the entry point group COMMAND_GROUP
(pyproject.toml: the bench package adds `bench` and `report`), found at start by `installed_commands`: bench
depends on this app, never the reverse."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from flame_llm.cli_demo import demo, print_results
from flame_llm.cli_serve import attach_service, serve, stop
from flame_llm.serving.http_app import HttpConfig
from flame_llm.serving.http_server import ARGUMENTS as SERVE_HTTP_ARGS
from flame_llm.serving.service_config import DEFAULT_NAMESPACE

log = logging.getLogger("flame_llm.cli")
COMMAND_GROUP = "flame_llm.commands"  # entry points naming a dict shaped like COMMANDS

def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}; got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}; got {v}")
        return v
    return parse


ARGS = {
    "config": (("--config",), {"help": "service YAML (configs/service.yaml; configs/demo.yaml on a CPU machine)"}),
    "namespace": (("--namespace",), {"help": "Ray namespace of the service (unset: the config's; without "
                                             f"--config: {DEFAULT_NAMESPACE}, or the one namespace running a "
                                             "service)"}),
    "address": (("--address",), {"help": "Ray address (unset: the config's, or auto: the Ray on this machine)"}),
    "json": (("--json",), {"action": "store_true", "help": "print JSON instead of a table"}),
}


def _read_prompts(path: str) -> list:
    """Prompts from a JSONL file: one token-id list or string per line; ValueError naming file and line."""
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                p = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not (isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                      for t in p))):
                raise ValueError(f"{path}:{n}: a prompt must be a string or a list of token ids; got "
                                 f"{type(p).__name__}")
            prompts.append(p)
    if not prompts:
        raise ValueError(f"{path}: no prompts (one JSON prompt per line)")
    return prompts


def submit(args) -> int:
    import numpy as np

    from flame_llm.sampling_params import SamplingParams
    from flame_llm.serving.client import Client

    if args.prompts:
        prompts = _read_prompts(args.prompts)
    else:
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(3, args.vocab, size=args.prompt_len).tolist() for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                        ignore_eos=args.ignore_eos)
    namespace = attach_service(args)
    client = Client.connect(namespace)
    t0 = time.perf_counter()
    try:
        results = [r.to_dict() for r in client.generate(prompts, sp, use_tqdm=len(prompts) > 64)]
    finally:
        client.close()
    elapsed = time.perf_counter() - t0
    if args.output:
        with open(args.output, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    print_results(results, elapsed)
    return 1 if any(r["error"] for r in results) else 0


def status(args) -> int:
    from flame_llm.serving.metrics import DECISIONS, quantile, shard_figures
    from flame_llm.serving.service import status as service_status

    st = service_status(attach_service(args))
    if args.json:
        print(json.dumps(st, indent=2, default=str))
        return 0
    router = st["router"]
    decisions = ", ".join(f"{label} {router['counters'].get(key, 0)}" for key, label in DECISIONS.items())
    print(f"namespace {st['namespace']}: router policy {router['policy']}, {router['entries']} prefixes; "
          f"decisions: {decisions}")
    routed = {s["shard"]: s for s in router["shards"]}
    print(f"{'shard':>5}  {'name':<6}  {'device':<12} {'node':<9} {'queued':>6} {'inflight':>8} {'admitted':>8} "
          f"{'rejected':>8} {'aborted':>7} {'running':>7} {'waiting':>7} {'kv use':>6} {'hit rate':>8} "
          f"{'batches':>7} {'payload raw/wire':>16} {'ttft p50':>8} {'e2e p50':>8}  outstanding work")
    for s in st["shards"]:
        if "error" in s:
            print(f"{s['shard']:>5}  unavailable: {s['error']}")
            continue
        f = shard_figures(s)
        h = s.get("histograms", {})
        ttft, e2e = (quantile(h[k], 0.5) if k in h else None for k in ("ttft_s", "e2e_s"))
        wire = f"{f['payload_raw']}/{f['payload_wire']}"
        print(f"{s['shard']:>5}  {s['name']:<6}  {s['device'][:12]:<12} {s['node'][:8]:<9} {f['queued']:>6} "
              f"{f['inflight']:>8} {f['admitted']:>8} {f['rejected']:>8} {f['aborted']:>7} {f['running']:>7} "
              f"{f['waiting']:>7} {100 * f['kv_usage']:>5.1f}% {100 * f['hit_rate']:>7.1f}% {f['batches']:>7} "
              f"{wire:>16} {_seconds(ttft):>8} {_seconds(e2e):>8}  "
              f"{routed.get(s['shard'], {}).get('outstanding_work', 0.0):.0f}")
    return 0


def _seconds(v: float | None) -> str:
    if v is None:
        return "-"
    return f"<={v:g}s" if v != float("inf") else ">120s"


def serve_http(args) -> int:
    from flame_llm.serving.http_server import serve as serve_engine_http
    return serve_engine_http(args, announce=lambda line: print(line, flush=True))


# name: (function, help, arguments)
COMMANDS = {
    "serve": (serve, "start or join Ray, create the router, one engine actor per GPU and the HTTP front door",
              ["config", (("--detach",), {"action": "store_true", "help": "return once up (needs ray.address)"}),
               (("--host",), {"help": f"front door address (unset: http.host, {HttpConfig().host})"}),
               (("--http-port",), {"type": int, "help": f"front door port (unset: http.port, {HttpConfig().port})"}),
               (("--api-key",), {"help": "front door bearer token (unset: http.api_key, else FLAME_API_KEY; shows "
                                         "in `ps`: prefer --api-key-file or the environment variable)"}),
               (("--api-key-file",), {"help": "a file of front door keys, one a line (unset: http.api_key_file)"}),
               (("--no-http",), {"action": "store_true", "help": "no HTTP front door"}),
               (("--tokenizer",), {"help": "an HF tokenizer directory or 'tiny' (unset: the config's tokenizer, "
                                           "else the model directory's)"})]),
    "submit": (submit, "submit prompts (a JSONL file of token-id lists or strings, or random ones)",
               ["config", "namespace", "address",
                (("--prompts",), {"help": "JSONL file, one prompt per line"}),
                (("--num-prompts",), {"type": _at_least(1), "default": 8, "help": "random prompts"}),
                (("--prompt-len",), {"type": _at_least(1), "default": 64, "help": "tokens per random prompt"}),
                (("--vocab",), {"type": _at_least(4), "default": 512,
                                "help": "random prompts draw ids in [3, vocab)"}),
                (("--max-tokens",), {"type": _at_least(1), "default": 16,
                                     "help": "output tokens per prompt (the engine stops at max_model_len: "
                                             "finish_reason 'length')"}),
                (("--temperature",), {"type": float, "default": 0.0, "help": "sampling temperature (0: greedy)"}),
                (("--seed",), {"type": int, "default": 0, "help": "random prompts' and sampling's seed"}),
                (("--ignore-eos",), {"action": "store_true", "help": "generate past the end-of-sequence token"}),
                (("--output",), {"help": "write result records here (JSONL)"})]),
    "status": (status, "shards, GPU UUIDs, nodes, queue depths, hit rates", ["config", "namespace", "address", "json"]),
    "stop": (stop, "stop the service (engine actors, router, front door) and the flame-llm serve that started it",
             ["config", "namespace", "address"]),
    "demo": (demo, "local Ray, two CPU shards, the tiny default model: one batch (what it sends and why tokens are "
                   "cached), placement and results, then a text prompt and a chat exchange",
             [(("--config",), {"help": "service YAML instead of the built-in demo config"}),
              (("--max-tokens",), {"type": _at_least(1), "default": 8, "help": "output tokens per prompt"})]),
    "serve-http": (serve_http, "our engine alone behind the OpenAI HTTP API (the front door's, without Ray)",
                   SERVE_HTTP_ARGS),
}


def installed_commands(group: str = COMMAND_GROUP) -> dict:
    """Commands installed packages add: each entry point of `group` names a dict shaped like COMMANDS. One that
    fails to load is skipped with a warning (its commands are missing, the others work); names of this module's
    commands are not taken over."""
    from importlib.metadata import entry_points

    found: dict = {}
    for ep in entry_points(group=group):
        try:
            commands = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken add-on must not take the service's commands down
            log.warning("commands of entry point %s (%s) not loaded: %s: %s", ep.name, ep.value, type(e).__name__, e)
            continue
        found.update({k: v for k, v in commands.items() if k not in COMMANDS})
    return found


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help; epilogs (examples) kept as written."""


def build_parser(commands: dict | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flame-llm", description="flame-llm: distributed LLM inference on Ray",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (fn, help_text, arguments, *epilog) in (commands or COMMANDS).items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=epilog[0] if epilog else None,
                           formatter_class=_HelpFormatter)
        for arg in arguments:
            flags, kwargs = ARGS[arg] if isinstance(arg, str) else arg
            p.add_argument(*flags, **kwargs)
        p.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None, commands: dict | None = None) -> int:
    """Run one subcommand of `commands` (default: this module's and the installed ones, installed_commands())."""
    args = build_parser(commands or {**COMMANDS, **installed_commands()}).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as e:  # OSError: missing files, unreachable Ray
        print(f"flame-llm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
