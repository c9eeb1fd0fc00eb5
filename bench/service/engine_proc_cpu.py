"""engine_process on vs off on CPU with the tiny model (issue 39): two `serve-http` processes, one with the engine's
step loop on a thread beside the HTTP loop (off), one with it in a child process (on), driven by the same closed-loop
streams as bench.service.stream_cpu (--streams streams of --output-tokens tokens back to back for --duration-s), windows
interleaved (off on on off ...). Per window: streamed tok/s, inter-chunk p50/p99, and the CPU microseconds per output
token of serve-http's process and of its engine process (psutil, user + system). The H200 figure is the load A/B:
`bash bench/device_run.sh load --systems engine,engine-proc,vllm ...`.

    python -m bench.service.engine_proc_cpu --streams 8 --output-tokens 128 --duration-s 8 --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time

from bench.http_client import SERVED_MODEL_NAME
from bench.load.loadgen import percentiles
from bench.provenance import write_json
from bench.service.stream_cpu import cpu_s, serve_http_pids, window

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a, engine_process: bool) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    engine = {"cpu_kvcache_gib": 0.25, "max_model_len": a.max_model_len, "max_num_batched_tokens": a.max_model_len,
              "max_num_seqs": max(16, a.streams), **json.loads(a.engine_json)}
    cmd = [sys.executable, "-m", "flame_llm.serving.http_server", "--model", a.model, "--port", str(port),
           "--served-model-name", SERVED_MODEL_NAME, "--engine-json", json.dumps(engine), "--torch-threads",
           str(a.torch_threads)] + (["--engine-process"] if engine_process else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if "listening on" in line:
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"serve-http (engine_process {engine_process}) exited with {proc.wait()} before listening")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.service.engine_proc_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--duration-s", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=2, help="windows per setting, interleaved (off on on off ...)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--engine-json", default="{}", help="engine fields of both servers")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import ray  # noqa: F401 - its bundled psutil, as in stream_cpu

    from flame_llm.config import load_hf_config
    from flame_llm.models.tiny import resolve_model

    vocab = load_hf_config(resolve_model(a.model)).vocab_size
    servers = {"off": start_server(a, False), "on": start_server(a, True)}
    rows = []
    try:
        for _, url in servers.values():  # warm both
            asyncio.run(window(url, a.streams, 8, a.prompt_tokens, vocab, 0.5, 99))
        order = [n for k in range(a.rounds) for n in (("off", "on") if k % 2 == 0 else ("on", "off"))]
        for k, name in enumerate(order):
            proc, url = servers[name]
            pids = serve_http_pids(proc.pid)
            before, t0 = cpu_s(pids), time.perf_counter()
            outs = asyncio.run(window(url, a.streams, a.output_tokens, a.prompt_tokens, vocab, a.duration_s, k))
            wall, after = time.perf_counter() - t0, cpu_s(pids)
            tokens = sum(o.output_tokens for o in outs)
            gaps = [b - x for o in outs for x, b in zip(o.chunk_s, o.chunk_s[1:])]
            per_tok = {n: 1e6 * (after[n] - before[n]) / tokens for n in after}
            rows.append({"engine_process": name, "round": k // 2, "tokens": tokens, "tok_s": tokens / wall,
                         "itl_s": percentiles(gaps), "cpu_us_per_token": per_tok,
                         "total_cpu_us_per_token": sum(per_tok.values()), "load_avg_1m": os.getloadavg()[0]})
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    print("| engine_process | round | tokens | tok/s | ITL p50 / p99 ms | serve-http us/tok | its engine process "
          "us/tok | total us/tok | load avg |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["cpu_us_per_token"]
        print(f"| {r['engine_process']} | {r['round']} | {r['tokens']} | {r['tok_s']:.0f} | "
              f"{1e3 * r['itl_s']['p50']:.2f} / {1e3 * r['itl_s']['p99']:.2f} | {c['serve-http']:.1f} | "
              f"{c.get('serve-http engine process', 0.0):.1f} | {r['total_cpu_us_per_token']:.1f} | "
              f"{r['load_avg_1m']:.1f} |")
    write_json(a.out, {"args": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
