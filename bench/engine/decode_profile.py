"""Where a decode step's time goes, our engine against vLLM in one call (issue 39): per step, by (decode rows, prefill
tokens in the step, context length), the wall time of back-to-back steps (as serving runs them: a user's TPOT at
that batch), the GPU kernel time (torch.profiler, a separate pass), the GPU idle time between them (wall - kernels:
where the host sets the pace) and, for our engine, the host time (wall minus the wait for the step's tokens); which
path each step took (CUDA graph or eager) and each engine's graph sizes.

    python -m bench.engine.decode_profile --vllm-pythonpath /tmp/vsite/site --out profile.json   # H200: the grid, both
    python -m bench.engine.decode_profile --systems engine --model tiny --batches 1,2 --contexts 64,128 \\
        --mixed 2x128+32 --steps 4 --out /tmp/p.json                                        # CPU: flame only

Grid: every batch x context (pure decode), and each --mixed shape BxC+P: B rows decoding at context C while every
step also prefills a fresh P-token prompt (max_tokens 1: it ends in that step). For each context the largest batch
is prefilled once (distinct random prompts, nothing shared) and smaller batches abort rows down to their size; a
point whose rows do not fit the engine's KV cache is listed as skipped. Each system runs in its own process (vLLM's
with its engine core in-process, so the profiler sees its kernels, and its own PYTHONPATH, as
bench.engine.kernel_split).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from bench import MODELS
from bench.engine.decode_drivers import make_driver
from bench.provenance import write_json

MODEL = os.path.join(MODELS, "llama-3.1-8b")
LIMITS = {"max_num_seqs": 64, "max_num_batched_tokens": 8192}  # the seed's (bench.burst.traces.SEED_LIMITS) but the
# length


@dataclass(slots=True)
class Point:
    batch: int
    context: int
    prefill: int = 0  # tokens of a fresh prompt prefilled in every timed step (0: pure decode)
    wall_ms: float | None = None  # mean over back-to-back steps
    gpu_ms: float | None = None  # kernel time per step (profiled pass; None without CUDA)
    idle_ms: float | None = None  # wall - gpu
    host_ms: float | None = None  # ours: wall minus the wait for the step's tokens
    paths: dict | None = None  # ours: steps per path (decode graph / mixed graph / eager)
    skipped: str = ""


def parse_mixed(spec: str) -> list[tuple[int, int, int]]:
    """"BxC+P,..." -> [(B, C, P)]; ValueError naming --mixed otherwise."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            bc, p = part.split("+")
            b, c = bc.split("x")
            out.append((int(b), int(c), int(p)))
        except ValueError:
            raise ValueError(f"--mixed must be BxC+P shapes, comma-separated (e.g. 32x8192+2048); got {part!r}") \
                from None
    return out


def _ints(spec: str, flag: str) -> list[int]:
    try:
        xs = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers; got {spec!r}") from None
    if not xs or xs[0] < 1:
        raise ValueError(f"{flag} must list integers >= 1; got {spec!r}")
    return xs


def _timed(drv, steps: int, feed: int = 0, rng=None) -> tuple[float, float]:
    """(mean wall seconds per step, mean seconds of it waiting for tokens) over `steps` back-to-back steps; feed: a
    fresh prompt of that many tokens is added before every step."""
    drv.sync()
    wait0 = drv.wait_s()
    t = time.perf_counter()
    for _ in range(steps):
        if feed:
            drv.add(rng.integers(0, drv.vocab, feed).tolist(), 1)
        drv.step()
    drv.sync()
    return (time.perf_counter() - t) / steps, (drv.wait_s() - wait0) / steps


def _point(drv, pt: Point, a, rng) -> None:
    _timed(drv, a.warm_steps, pt.prefill, rng)
    paths0 = drv.paths()
    wall, wait = _timed(drv, a.steps, pt.prefill, rng)
    paths1 = drv.paths()
    pt.wall_ms = 1e3 * wall
    if drv.counts_wait:
        pt.host_ms = 1e3 * (wall - wait)
    if paths1 is not None:
        pt.paths = {k: v - paths0.get(k, 0) for k, v in paths1.items() if v - paths0.get(k, 0)}
    if drv.on_cuda and a.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _timed(drv, a.profile_steps, pt.prefill, rng)
        kernel_us = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                        for e in prof.key_averages() if e.key and not e.key.startswith("ProfilerStep"))
        pt.gpu_ms = kernel_us / 1e3 / a.profile_steps
        pt.idle_ms = pt.wall_ms - pt.gpu_ms
    print(a.one, json.dumps({k: v for k, v in asdict(pt).items() if v not in (None, "")}), flush=True)


def run_one(system: str, a) -> dict:
    """The whole grid on one system, loaded once."""
    batches, contexts, mixed = _ints(a.batches, "--batches"), _ints(a.contexts, "--contexts"), parse_mixed(a.mixed)
    # a row lives through every point at its context: its answer must outlast them all (and never end one early)
    headroom = (len(batches) + len(mixed)) * (a.warm_steps + a.steps + a.profile_steps) + 16
    t0 = time.perf_counter()
    drv = make_driver(system, a.model, {**LIMITS, "max_model_len": max(contexts + [c for _, c, _ in mixed]) +
                                        headroom, **json.loads(a.engine_json)})
    info = {"system": system, "load_s": time.perf_counter() - t0, **drv.info()}
    rng = np.random.default_rng(a.seed)
    points: list[Point] = []
    for c in sorted(set(contexts) | {c for _, c, _ in mixed}):
        want = sorted({b for b in batches if c in contexts} | {b for b, cc, _ in mixed if cc == c}, reverse=True)
        per_row = c + headroom
        fits = [b for b in want if b * per_row + max([p for _, cc, p in mixed if cc == c], default=0)
                <= 0.95 * drv.capacity_tokens() and b <= LIMITS["max_num_seqs"]]
        for b in want:
            if b not in fits:
                pts = [Point(b, c)] * (c in contexts and b in batches) + [Point(b, c, p) for bb, cc, p in mixed
                                                                            if (bb, cc) == (b, c)]
                for pt in pts:
                    pt.skipped = f"{b} x {per_row} tokens over 95% of the KV cache ({drv.capacity_tokens()} tokens)"
                points += pts
        if not fits:
            continue
        rows = [drv.add(rng.integers(0, drv.vocab, c).tolist(), headroom) for _ in range(fits[0])]
        drv.prefill_all()
        for b in fits:
            drv.abort(rows[b:])
            rows = rows[:b]
            if c in contexts and b in batches:
                points.append(Point(b, c))
                _point(drv, points[-1], a, rng)
            for bb, cc, p in mixed:
                if (bb, cc) == (b, c):
                    points.append(Point(b, c, p))
                    _point(drv, points[-1], a, rng)
        drv.abort(rows)
        drv.drain()
    return {**info, "points": [asdict(p) for p in points]}


def _key(p: dict) -> tuple:
    return p["batch"], p["context"], p["prefill"]


def render(results: list[dict]) -> str:
    """One row per grid point: each system's wall / GPU / idle ms per step and, with two systems, first / second."""
    by = [{_key(p): p for p in r["points"]} for r in results]
    names = [r["system"] for r in results]
    keys = sorted({k for b in by for k in b})
    head = "| decode rows | context | prefill tokens | " + " | ".join(
        f"{n} wall / GPU / idle ms | {n} path" for n in names) + (
        f" | {names[0]} / {names[1]} wall | GPU |" if len(names) > 1 else " |")
    lines = [head, "|---" * (3 + 2 * len(names) + (2 if len(names) > 1 else 0)) + "|"]

    def cell(p: dict | None) -> str:
        if p is None:
            return "-"
        if p["skipped"]:
            return "skipped (KV)"
        f = [p["wall_ms"], p["gpu_ms"], p["idle_ms"]]
        return " / ".join("n/a" if x is None else f"{x:.2f}" for x in f)

    def path(p: dict | None, r: dict) -> str:
        """Ours: the path its timed steps took (counted); vLLM: the graph size a decode batch pads to (its config)."""
        if p is None or p["skipped"]:
            return "-"
        if p.get("paths"):
            return ", ".join(f"{k} {v}" for k, v in sorted(p["paths"].items()))
        sizes = [s for s in r.get("graph_sizes") or [] if s >= p["batch"] + (1 if p["prefill"] else 0)]
        if p["prefill"]:
            return "mixed (piecewise or eager: see its config)"
        return f"graph {sizes[0]}" if sizes else "eager (no graph size fits)"

    def ratio(x, y) -> str:
        return f"{x / y:.3f}" if x is not None and y else "n/a"

    for k in keys:
        ps = [b.get(k) for b in by]
        row = f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(f"{cell(p)} | {path(p, r)}" for p, r in zip(ps, results))
        if len(ps) > 1:
            a_, b_ = ps[0] or {}, ps[1] or {}
            row += f" | {ratio(a_.get('wall_ms'), b_.get('wall_ms'))} | {ratio(a_.get('gpu_ms'), b_.get('gpu_ms'))}"
        lines.append(row + " |")
    for r in results:
        extra = {k: r[k] for k in ("attention_backend", "async_scheduling", "mixed_graph_tokens", "cudagraph_mode",
                                   "vllm", "kv_capacity_tokens") if r.get(k) not in (None, "")}
        lines.append(f"\n{r['system']}: CUDA graph batch sizes {r.get('graph_sizes') or 'none'}; {extra}")
    return "\n".join(lines)


def system_env(system: str, vllm_pythonpath: str) -> dict:
    from bench.engine.kernel_split import system_env as env
    return env(system, vllm_pythonpath)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine.decode_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="engine,vllm", help="engine (ours), vllm (skipped with a note when it does "
                   "not import)")
    p.add_argument("--model", default=MODEL, help="model dir (dummy weights) or 'tiny'")
    p.add_argument("--batches", default="1,8,16,32,64")
    p.add_argument("--contexts", default="1024,4096,8192,16384,32768")
    p.add_argument("--mixed", default="16x8192+512,32x8192+2048,64x4096+512,64x4096+2048",
                   help="BxC+P: B decode rows at context C, a fresh P-token prefill in every step")
    p.add_argument("--steps", type=int, default=24, help="timed back-to-back steps per point")
    p.add_argument("--warm-steps", type=int, default=4)
    p.add_argument("--profile-steps", type=int, default=8, help="steps under torch.profiler (CUDA only; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-json", default="{}", help="more Config fields for both (ours) / LLM args (vLLM)")
    p.add_argument("--vllm-pythonpath", default="", help="PYTHONPATH of the vLLM process (its bundle's site)")
    p.add_argument("--timeout-s", type=float, default=540.0, help="per system process")
    p.add_argument("--out", required=True)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one system in this process
    a = p.parse_args(argv)
    try:
        _ints(a.batches, "--batches"), _ints(a.contexts, "--contexts"), parse_mixed(a.mixed)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if a.one:
        write_json(a.out, run_one(a.one, a))
        return 0
    systems = [s for s in a.systems.split(",") if s]
    if set(systems) - {"engine", "vllm"}:
        raise SystemExit(f"--systems: engine and/or vllm; got {a.systems!r}")
    results, notes = [], []
    for system in systems:
        part = f"{a.out}.{system}.json"
        args = [x for x in (argv if argv is not None else sys.argv[1:])]
        cmd = [sys.executable, "-m", "bench.engine.decode_profile", *args, "--one", system, "--out", part]
        try:
            rc = subprocess.run(cmd, env=system_env(system, a.vllm_pythonpath), timeout=a.timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc == 0:
            results.append(json.load(open(part)))
        else:
            notes.append(f"{system}: its run failed ({rc}); see its output above")
            print(notes[-1], flush=True)
    write_json(a.out, {"argv": sys.argv if argv is None else argv, "results": results, "notes": notes})
    if results:
        print(render(results))
    return 0 if len(results) == len(systems) else 1


if __name__ == "__main__":
    sys.exit(main())
