"""Clients we did not write against OpenAI servers (issue 41): `vllm bench serve` (vLLM's benchmark client) and
guidellm, run unchanged, against flame's front door (`flame-llm serve` / `serve-http`) and `vllm serve` in one
call. Each run's own counters (completed / failed) and medians and p99s are read from the client's result file;
for a flame target, /metrics's `flame_http_requests_total` before and after says how many requests the server
answered (status 200 on POST /v1/*), to set beside the client's count, what it refused (any status not 2xx, on
any route: where a client trips on the API), and what its engines did meanwhile (`server_steps`: steps, mixed and
eager steps, prefill and decode tokens, GPU busy / idle and host seconds from the step timeline, summed over shards:
where a TPOT beside vLLM's goes, issue 39/41).

    python3 -m bench.load.external_clients --client vllm --client guidellm --target http://127.0.0.1:8000 \\
        --target http://127.0.0.1:8001 --tokenizer DIR --num-prompts 200 --input-len 1024 --output-len 256 \\
        --rate 4 --rate 8 --rate 16 --rate inf --out bench/results/external_clients

The vLLM client runs as `vllm bench serve` where the `vllm` command is installed, else (--vllm-site DIR: vLLM's
wheel unpacked without its dependencies, as .ci/run does on CPU) as the same `vllm.benchmarks.serve.main` on that
PYTHONPATH. guidellm runs from --guidellm (default: `guidellm` on PATH, else .ci/run's venv). Exit 1 when any run
had a failed request."""
from __future__ import annotations

import argparse
import glob
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass

log = logging.getLogger(__name__)
CLIENTS = ("vllm", "guidellm")
GUIDELLM_VENV = os.path.join(os.path.expanduser("~"), ".cache", "flame_llm", "guidellm-venv", "bin", "guidellm")
# vllm bench serve's main, as its `vllm bench serve` subcommand calls it (vllm/entrypoints/cli/benchmark/serve.py)
VLLM_MAIN = ("import sys\nfrom vllm.utils.argparse_utils import FlexibleArgumentParser\n"
             "from vllm.benchmarks.serve import add_cli_args, main\n"
             "p = FlexibleArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))\n")


# the engines' step counters a run's record keeps (flame_shard_<name>_total, serving/metrics.ENGINE_COUNTERS)
STEP_COUNTERS = ("decode_steps", "prefill_steps", "mixed_steps", "mixed_graph_steps", "prefill_tokens",
                 "decode_tokens", "timeline_steps", "gpu_busy_seconds", "gpu_idle_seconds", "gpu_idle_gaps",
                 "host_step_seconds", "sync_wait_seconds", "eager_timed_steps", "eager_gpu_seconds",
                 "long_launches", "long_launch_seconds")


@dataclass(slots=True)
class FlameScrape:
    """One read of a flame server's /metrics: answered HTTP requests by (route, method, status), and the engines'
    step counters summed over shards."""
    requests: dict[tuple[str, str, str], int]
    steps: dict[str, float]


def flame_scrape(target: str) -> FlameScrape | None:
    """A flame server's /metrics, read once (None: not flame's)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{target}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    counts, steps, seen = {}, dict.fromkeys(STEP_COUNTERS, 0.0), False
    for fam in text_string_to_metric_families(text):
        if fam.name == "flame_http_requests":
            seen = True
            counts.update({(s.labels["route"], s.labels["method"], s.labels["status"]): int(s.value)
                           for s in fam.samples if s.name.endswith("_total")})
        elif fam.name.removeprefix("flame_shard_") in steps:
            steps[fam.name.removeprefix("flame_shard_")] += sum(s.value for s in fam.samples
                                                                 if s.name.endswith("_total"))
    return FlameScrape(counts, steps) if seen else None


def server_steps(before: FlameScrape | None, after: FlameScrape | None) -> dict:
    """The engines' step counters over a run (None: not a flame server), with ms a step and the GPU's idle share."""
    if before is None or after is None:
        return {"server_steps": None}
    d = {k: round(after.steps[k] - before.steps[k], 6) for k in STEP_COUNTERS}
    steps = d["decode_steps"] + d["prefill_steps"]
    timed = d["gpu_busy_seconds"] + d["gpu_idle_seconds"]
    return {"server_steps": {**d, "steps": steps,
                             "gpu_ms_per_timed_step": 1e3 * d["gpu_busy_seconds"] / d["timeline_steps"]
                             if d["timeline_steps"] else None,
                             "gpu_idle_share": d["gpu_idle_seconds"] / timed if timed else None}}


def server_counts(before: dict | None, after: dict | None) -> dict:
    """What the server answered between two reads of its requests (FlameScrape.requests): POST /v1/* with 200 (the
    client's requests), and any route with a status that is not 2xx (a client that trips on the API: a 404 for a
    route it asks for, a 400)."""
    if before is None or after is None:
        return {"server_answered_200": None, "server_not_ok": None}
    delta = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    return {"server_answered_200": sum(n for (route, method, status), n in delta.items()
                                       if route.startswith("/v1/") and method == "POST" and status == "200"),
            "server_not_ok": {f"{method} {route} {status}": n for (route, method, status), n in sorted(delta.items())
                              if not status.startswith("2")}}


def served_model(target: str) -> str:
    with urllib.request.urlopen(f"{target}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def vllm_command(vllm_site: str | None) -> tuple[list[str], dict]:
    if vllm_site is None and shutil.which("vllm"):
        return ["vllm", "bench", "serve"], {}
    assert vllm_site, "no `vllm` command: pass --vllm-site (vLLM's wheel unpacked without its dependencies)"
    path = os.pathsep.join(p for p in (vllm_site, os.environ.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-c", VLLM_MAIN], {"PYTHONPATH": path}


def vllm_argv(a: argparse.Namespace, target: str, model: str, rate: float, out: str) -> list[str]:
    """`vllm bench serve`'s flags (rate inf: every request at once, or --max-concurrency at a time)."""
    argv = ["--backend", "openai", "--base-url", target, "--model", model, "--tokenizer", a.tokenizer,
            "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len",
            str(a.output_len), "--num-prompts", str(a.num_prompts), "--request-rate", str(rate), "--ignore-eos",
            "--seed", str(a.seed), "--save-result", "--result-dir", out]
    return argv + (["--max-concurrency", str(a.max_concurrency)] if a.max_concurrency else [])


def run_vllm(a: argparse.Namespace, target: str, model: str, rate: float, out: str) -> dict:
    cmd, env = vllm_command(a.vllm_site)
    _run(cmd + vllm_argv(a, target, model, rate, out), env, a.timeout_s, out)
    r = json.load(open(max(glob.glob(os.path.join(out, "*.json")), key=os.path.getmtime)))
    keys = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl") for s in ("median", "p99")]
    return {"completed": r["completed"], "failed": r["failed"], "req_per_s": r["request_throughput"],
            "output_tok_per_s": r["output_throughput"], **{k: r[k] for k in keys}}


def guidellm_profile(rate: float, num_prompts: int, max_concurrency: int | None) -> str:
    """guidellm's --profile for a rate. inf is its throughput profile, which needs max_concurrency (0.8.1 refuses
    it without one: "Field required (at 'profile.throughput.max_concurrency')"): --max-concurrency, else every
    prompt at once, as vLLM's client sends at rate inf."""
    if math.isinf(rate):
        return f"kind=throughput,max_concurrency={max_concurrency or num_prompts}"
    return f"kind=constant,rate={rate:g}" + (f",max_concurrency={max_concurrency}" if max_concurrency else "")


def guidellm_argv(a: argparse.Namespace, target: str, model: str, rate: float, path: str) -> list[str]:
    return ["run", "--backend", f"kind=openai_http,target={target},model={model}", "--profile",
            guidellm_profile(rate, a.num_prompts, a.max_concurrency), "--constraint",
            f"kind=max_requests,count={a.num_prompts}", "--tokenizer", f"kind=huggingface_auto,model={a.tokenizer}",
            "--data", f"kind=synthetic_text,prompt_tokens={a.input_len},output_tokens={a.output_len}", "--output",
            f"kind=json,path={path}", "--disable-console-interactive", "--seed", f"kind=static,value={a.seed}"]


def run_guidellm(a: argparse.Namespace, target: str, model: str, rate: float, out: str) -> dict:
    exe = a.guidellm or shutil.which("guidellm") or GUIDELLM_VENV
    path = os.path.join(out, "guidellm.json")
    _run([exe, *guidellm_argv(a, target, model, rate, path)], {}, a.timeout_s, out)
    m = json.load(open(path))["benchmarks"][0]["metrics"]
    totals = m["request_totals"]

    def stat(name: str, p: str) -> float:
        s = m[name]["successful"]
        return s["median"] if p == "median" else s["percentiles"]["p99"]

    names = {"ttft": "time_to_first_token_ms", "tpot": "time_per_output_token_ms", "itl": "inter_token_latency_ms"}
    return {"completed": totals["successful"], "failed": totals["errored"] + totals["incomplete"],
            "req_per_s": m["requests_per_second"]["successful"]["mean"],
            "output_tok_per_s": m["output_tokens_per_second"]["successful"]["mean"],
            **{f"{p}_{k}_ms": stat(n, p) for k, n in names.items() for p in ("median", "p99")}}


def _run(cmd: list[str], env: dict, timeout_s: float, out: str) -> None:
    with open(os.path.join(out, "client.log"), "w") as f:
        proc = subprocess.run(cmd, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {proc.returncode}; its output: {os.path.join(out, 'client.log')}")


def run(a: argparse.Namespace) -> list[dict]:
    """Every client x target x rate; one record each (also appended to OUT/summary.jsonl)."""
    records = []
    for target in a.target:
        model = a.model or served_model(target)
        for client in a.client:
            for i, rate in enumerate(a.rate):
                # each rate its own prompts (both clients' --seed: seed + the rate's index): with one seed, every rate
                # after the first replays prompts the server's prefix cache already holds (session 23's H100 run)
                ra = argparse.Namespace(**{**vars(a), "seed": a.seed + i})
                out = os.path.join(a.out, f"{client}-{target.split('//')[-1].replace(':', '_')}-rate{rate:g}")
                os.makedirs(out, exist_ok=True)
                before = flame_scrape(target)
                rec = (run_vllm if client == "vllm" else run_guidellm)(ra, target, model, rate, out)
                after = flame_scrape(target)
                # rate inf as "inf": json.dumps would write Infinity, which strict JSON readers (jq) refuse
                rec = {"client": client, "target": target, "model": model,
                       "rate": "inf" if math.isinf(rate) else rate, "seed": ra.seed, **rec,
                       **server_counts(before and before.requests, after and after.requests),
                       **server_steps(before, after)}
                log.info("%s", json.dumps(rec))
                with open(os.path.join(a.out, "summary.jsonl"), "a") as f:
                    f.write(json.dumps(rec) + "\n")
                records.append(rec)
    return records


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m bench.load.external_clients", description=__doc__.split("\n\n")[0])
    p.add_argument("--client", action="append", choices=CLIENTS, help="repeatable (default: both)")
    p.add_argument("--target", action="append", required=True, help="server base URL, repeatable")
    p.add_argument("--model", default=None, help="served model name (default: each target's /v1/models)")
    p.add_argument("--tokenizer", required=True, help="the tokenizer directory the clients count tokens with")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--rate", action="append", type=float, help="requests/s, repeatable; inf: as fast as it can")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (vLLM's --max-concurrency; guidellm's max_concurrency; unset: "
                        "no bound, and at rate inf guidellm's throughput profile runs num-prompts at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-site", default=None, help="vLLM's wheel unpacked (without `vllm` installed)")
    p.add_argument("--guidellm", default=None, help="the guidellm executable")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per client run")
    p.add_argument("--out", default="bench/results/external_clients")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    a = parser().parse_args(argv)
    a.client, a.rate = a.client or list(CLIENTS), a.rate or [math.inf]
    records = run(a)
    return 1 if any(r["failed"] for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
