"""One burst run, the `ray job submit` entrypoint:

    ray job submit --working-dir . -- python -m bench.burst.runner --system flame --trace reuse --out bench/results/x

starts the system fresh, runs the warmup rounds, releases the measured burst, stops the system, checks every
request and writes the raw per-request JSON (outside the burst: start, warmup, checks, stop). `bench.burst.pairs`
calls `run_one` for five interleaved pairs; `bench.burst.report` renders what the raw files hold.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import os
import platform
import sys
import time
from collections import Counter
from dataclasses import asdict

from bench.burst.traces import BURST_TRACES, DECODE_TRACE, Trace, TraceConfig, make_trace, warmup_traces
from bench.provenance import call_info, machine_info
from bench.run_options import (  # noqa: F401 - re-exported: the run's options are imported from here too
    BENCH_EPILOG,
    RUN_ARGUMENTS,
    RunOptions,
    add_run_args,
    check_bench_memory,
    engine_config,
    model_dir,
    options_from_args,
    resolve_options,
)
from bench.system_config import Setup, parse_system
from bench.systems import make_system
from flame_llm.protocol.types import prompt_digest

log = logging.getLogger(__name__)
RAW_FORMAT = "flame-bench-raw/1"


def plan_devices(o: RunOptions) -> list[str]:
    """Shard k's device, by the service's own placement rule on this node (GPUs in index order)."""
    from actors.pinning import NodeGPUs, local_gpu_uuids, plan_shards

    uuids = tuple(local_gpu_uuids())
    n = o.num_shards or ("auto" if uuids else 2)
    places = plan_shards([NodeGPUs("local", uuids, len(uuids))], n, 2, tuple(o.gpu_uuids))
    return [p.gpu_uuid or p.name for p in places]


def check_round_robin(labels: list[str], o: RunOptions) -> None:
    """An -rr system places requests round-robin over the shards: over one shard it is the sticky system under
    another name, so an affinity A/B there would measure nothing."""
    rr = [s for s in labels if s.endswith("-rr")]
    if rr and (n := len(plan_devices(o))) < 2:
        raise SystemExit(f"--systems {','.join(rr)}: round-robin placement needs 2 or more shards (replicas); "
                         f"{n} planned here (--num-shards, or a machine with more GPUs)")


def build_setup(o: RunOptions, log_dir: str) -> Setup:
    from flame_llm.config import default_model_revision

    model = model_dir(o)
    addr = os.environ.get("RAY_ADDRESS") or None  # set by `ray job submit`; empty or unset: a local Ray
    return Setup(model=model, model_revision=default_model_revision(model), devices=plan_devices(o),
                 engine=engine_config(o), load_format=o.load_format, log_dir=log_dir, ray_address=addr,
                 torch_threads=o.torch_threads, startup_timeout_s=o.startup_timeout_s,
                 burst_timeout_s=o.burst_timeout_s, vllm_bin=o.vllm_bin, vllm_pythonpath=o.vllm_pythonpath,
                 vllm_args=o.vllm_args, vllm_return_token_ids=o.vllm_return_token_ids)


def trace_config(o: RunOptions, name: str, model_dir: str) -> TraceConfig:
    from flame_llm.config import load_hf_config

    vocab = load_hf_config(model_dir).vocab_size
    if name == DECODE_TRACE:  # its own shape (--decode-*): prompt lengths include the question
        (p_lo, p_hi), (o_lo, o_hi) = o.decode_range("decode_prompt_tokens"), o.decode_range("decode_output_tokens")
        q = min(o.question_tokens, p_lo - 1)
        return TraceConfig(name=name, num_docs=o.decode_prompts, doc_tokens=p_hi - q, min_doc_tokens=p_lo - q,
                           question_tokens=q, output_tokens=o_lo, max_output_tokens=o_hi, seed=o.seed,
                           vocab_size=vocab)
    return TraceConfig(name=name, num_docs=o.docs, questions=o.questions, doc_tokens=o.doc_tokens,
                     question_tokens=o.question_tokens, output_tokens=o.output_tokens, seed=o.seed, vocab_size=vocab)


def check_run(trace: Trace, records: list[dict], placement: list[str]) -> dict:
    """Every request: prompt digest (as sent, and as served where the system reports it), answered exactly once,
    prompt and output length, no error, placement equal to the shard -> device map."""
    want = {r.rid: r for r in trace.requests}
    seen = Counter(rec["id"] for rec in records)
    fails: Counter = Counter()
    examples: list[str] = []

    def fail(kind: str, msg: str) -> None:
        fails[kind] += 1
        if len(examples) < 20:
            examples.append(msg)

    for rid in sorted(set(want) - set(seen)):
        fail("missing", f"{rid}: no answer")
    for rid, n in sorted(seen.items()):
        if rid not in want:
            fail("unexpected", f"{rid}: not in the trace")
        elif n > 1:
            fail("duplicate", f"{rid}: answered {n} times")
    for rec in records:
        req = want.get(rec["id"])
        if req is None:
            continue
        if rec.get("error"):
            fail("error", f"{rec['id']}: {rec['error']}")
            continue
        if prompt_digest(req.token_ids) != req.prompt_digest:
            fail("prompt_digest", f"{rec['id']}: the prompt handed to the system no longer has the trace's digest")
        if rec.get("prompt_digest") not in ("", req.prompt_digest):  # "": the system does not report it
            fail("prompt_digest", f"{rec['id']}: served prompt digest {rec['prompt_digest']} != {req.prompt_digest}")
        if rec["prompt_tokens"] != len(req.token_ids):
            fail("prompt_tokens", f"{rec['id']}: {rec['prompt_tokens']} prompt tokens served, "
                                  f"{len(req.token_ids)} sent")
        n_out = req.max_tokens or trace.config.output_tokens
        if rec["output_len"] != n_out or rec["finish_reason"] != "length":
            fail("output_len", f"{rec['id']}: {rec['output_len']} tokens ({rec['finish_reason']}), want {n_out}")
        shard = rec.get("shard")
        if not isinstance(shard, int) or not 0 <= shard < len(placement) or rec["device"] != placement[shard]:
            fail("placement", f"{rec['id']}: shard {shard} answered from {rec['device']!r}; map {placement}")
    return {"ok": not fails, "failures": dict(fails), "examples": examples, "requests": len(records),
            "expected": len(want)}


def run_one(o: RunOptions, label: str, trace_name: str, pair: int = 0, position: int = 0,
            call: dict | None = None) -> dict:
    """Start `label` fresh, warm up, run one measured burst, stop; write and return the raw record. `call`: the
    invocation it belongs to (bench.provenance.call_info; a call of its own when None)."""
    sys_cfg = parse_system(label, o.policy)
    tag = f"{trace_name}-{label}-pair{pair:02d}"
    setup = build_setup(o, os.path.join(o.out, "logs"))
    trace_cfg = trace_config(o, trace_name, setup.model)
    trace, warm = make_trace(trace_cfg), warmup_traces(trace_cfg, o.warmup_rounds)
    raw = {"format": RAW_FORMAT, "label": label, "system": sys_cfg.kind, "vllm_config": sys_cfg.vllm_config,
           "policy": sys_cfg.policy, "trace": trace.describe(), "warmup_shifts": [w.shift for w in warm],
           "pair": pair, "position": position, "started_at": dt.datetime.now(dt.timezone.utc).isoformat(),
           "host": platform.node(), "python": sys.version.split()[0], "options": asdict(o),
           "engine_config": setup.engine, "model": setup.model, "model_revision": setup.model_revision,
           "placement": setup.devices, "error": None, "machine": machine_info(),
           "call": call or call_info(pair, 1, sys.argv)}
    system = make_system(sys_cfg, setup, tag)
    timings: dict = {}
    records: list[dict] = []
    t0 = time.perf_counter()
    try:
        raw["start"] = system.start()
        t1 = time.perf_counter()
        for k, w in enumerate(warm):
            _, wrecs = system.run_burst(w.requests, trace_cfg.output_tokens)
            wcheck = check_run(w, wrecs, setup.devices)
            if not wcheck["ok"]:
                raise RuntimeError(f"warmup round {k + 1} failed its checks: {wcheck['failures']} "
                                   f"{wcheck['examples'][:3]}")
        t2 = time.perf_counter()
        t_release, records = system.run_burst(trace.requests, trace_cfg.output_tokens)
        timings["burst_wall_s"] = time.perf_counter() - t_release
        raw["stats"] = system.stats()
        timings.update(start_s=t1 - t0, warmup_s=t2 - t1)
    except Exception as e:
        log.exception("%s: run failed", tag)
        raw["error"] = f"{type(e).__name__}: {e}"
    finally:
        t3 = time.perf_counter()
        try:
            system.stop()
        except Exception as e:
            log.exception("%s: stop failed", tag)
            raw["error"] = raw["error"] or f"stop failed: {type(e).__name__}: {e}"
        timings["stop_s"] = time.perf_counter() - t3
    raw["timings"] = timings
    by_id = {r.rid: r for r in trace.requests}
    raw["requests"] = [{**r, "doc": by_id[r["id"]].doc, "question": by_id[r["id"]].question} if r["id"] in by_id
                       else r for r in records]
    raw["checks"] = check_run(trace, records, setup.devices)
    if raw["error"]:
        raw["checks"]["ok"] = False
    path = os.path.join(o.out, "raw", trace_name, label, f"pair{pair:02d}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(raw, f)
    raw["path"] = path
    return raw


@contextlib.contextmanager
def local_ray_scope():
    """Shut down a Ray that a flame run started locally (never one this process was already attached to).
    Ray is not imported here: runs of HTTP systems alone need no Ray."""
    ray = sys.modules.get("ray")
    attached = ray is not None and ray.is_initialized()
    try:
        yield
    finally:
        ray = sys.modules.get("ray")
        if ray is not None and not attached and ray.is_initialized():
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.burst.runner", description="one fresh burst run, raw JSON out")
    p.add_argument("--system", required=True, help="flame | engine | vllm | vllm-seed, optionally with -rr")
    p.add_argument("--trace", required=True, choices=BURST_TRACES)
    p.add_argument("--pair", type=int, default=0, help="pair index recorded for the report")
    add_run_args(p)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_bench_memory(a)
    with local_ray_scope():
        raw = run_one(options_from_args(a), a.system, a.trace, a.pair)
    n = len(raw["requests"])
    burst = max((r["done_s"] for r in raw["requests"]), default=0.0)
    print(f"{a.system} {a.trace}: {n} requests in {burst:.3f}s = {n / burst if burst else 0:.3f} req/s; "
          f"checks {'ok' if raw['checks']['ok'] else 'FAILED ' + json.dumps(raw['checks']['failures'])}; "
          f"raw: {raw['path']}")
    return 0 if raw["checks"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
