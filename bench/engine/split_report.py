"""The pure parts of bench.engine.kernel_split: the A-B-B-A run order, a trace's FLOPs at an ideal prefix cache
and its roofline time, and the tables (groups per run, both orders, kernels side by side).

FLOPs: every linear layer of every computed token (2 x its weights), the LM head of every sampled token,
and causal attention 4 x layers x q_heads x head_dim per (query, key) pair a computed token sees. A token
is computed unless an earlier request of the trace shares its whole block-aligned prefix (the ideal prefix
cache at `block` tokens); each request then decodes output_tokens - 1 more tokens."""
from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass

import numpy as np

H200_BF16_TFLOPS = 790.0  # dense bf16 matmul measured on an H200 here (KINDS.md: 769-798; design.md)
GROUPS = ("gemm", "attention", "other")


def abba(systems: list[str]) -> list[str]:
    """Run order: A B B A for two systems (each order once); one system runs once; more systems run
    forwards then backwards, so each position's bias falls on every system."""
    if len(systems) <= 1:
        return list(systems)
    return list(systems) + list(reversed(systems))


@dataclass(slots=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, path: str) -> ModelShape:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return cls(c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                   c.get("num_key_value_heads", c["num_attention_heads"]), head_dim, c["vocab_size"])

    @property
    def linear_flops_per_token(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        params = self.hidden * (q + 2 * kv) + q * self.hidden + self.hidden * 2 * self.intermediate \
            + self.intermediate * self.hidden
        return 2 * self.layers * params

    def attention_flops(self, start: int, end: int) -> int:
        """Causal attention FLOPs of positions [start, end) (position p sees p + 1 keys)."""
        pairs = end * (end + 1) // 2 - start * (start + 1) // 2
        return 4 * self.layers * self.heads * self.head_dim * pairs


def computed_starts(prompts: list[np.ndarray], block: int = 16) -> list[int]:
    """Per prompt, the first position it must compute: past the longest block-aligned prefix an earlier
    prompt of the list already computed (a prompt's last token is always computed: it samples)."""
    seen: set[bytes] = set()
    starts = []
    for p in prompts:
        p = np.ascontiguousarray(p, dtype=np.int64)
        full = len(p) // block
        keys = [p[: (b + 1) * block].tobytes() for b in range(full)]
        hit = 0
        while hit < full and keys[hit] in seen:
            hit += 1
        seen.update(keys)
        starts.append(min(hit * block, len(p) - 1))
    return starts


def trace_flops(shape: ModelShape, prompts: list[np.ndarray], output_tokens: int, block: int = 16) -> dict:
    """FLOPs of serving the prompts (each then decoding output_tokens - 1 tokens) at the ideal prefix cache."""
    linear = attention = head = 0
    computed = 0
    for p, start in zip(prompts, computed_starts(prompts, block)):
        end = len(p) + output_tokens - 1  # the last sampled token is never fed back
        computed += end - start
        linear += shape.linear_flops_per_token * (end - start)
        attention += shape.attention_flops(start, end)
        head += 2 * shape.hidden * shape.vocab * output_tokens
    total = linear + attention + head
    return {"flops": total, "linear_flops": linear, "attention_flops": attention, "lm_head_flops": head,
            "computed_tokens": computed, "prompt_tokens": sum(len(p) for p in prompts)}


def roofline(flops: dict, wall_s: float, requests: int, peak_tflops: float) -> dict:
    """Roofline time of the trace at peak_tflops and the fraction of it a run of wall_s reaches."""
    t = flops["flops"] / (peak_tflops * 1e12)
    return {"peak_tflops": peak_tflops, "roofline_s": t, "roofline_req_per_s": requests / t,
            "fraction": t / wall_s if wall_s > 0 else 0.0, "achieved_tflops": flops["flops"] / wall_s / 1e12}


def _runs(results: list[dict]) -> list[tuple[str, dict, str]]:
    """(column label, run, trace) for every run and trace, in run order."""
    return [(f"{r.get('label') or r['system']} #{r.get('run', i) + 1}", r, t)
            for i, r in enumerate(results) for t in r["traces"]]


def render_groups(results: list[dict]) -> str:
    """Seconds per kernel group, req/s and the roofline fraction of every run (in run order)."""
    cols = _runs(results)
    lines = ["| seconds | " + " | ".join(f"{label} {t}" for label, _, t in cols) + " |",
             "|---|" + "---|" * len(cols)]
    rows = [("req_per_s", "req/s (plain burst)"), ("wall_profiled_s", "wall (profiled round)"),
            ("gemm_s", "GEMM"), ("attention_s", "attention"), ("other_s", "other kernels"),
            ("idle_s", "GPU idle (wall - kernels)")]
    for key, name in rows:
        lines.append(f"| {name} | " + " | ".join(f"{r['traces'][t][key]:.3f}" for _, r, t in cols) + " |")
    if all("roofline" in r["traces"][t] for _, r, t in cols):
        lines.append("| roofline fraction (profiled) | " + " | ".join(
            f"{r['traces'][t]['roofline']['fraction']:.3f}" for _, r, t in cols) + " |")
    return "\n".join(lines)


def mean_by_system(results: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """system label -> trace -> mean of each numeric field over that system's runs."""
    acc: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: collections.defaultdict(list)))
    for r in results:
        for t, row in r["traces"].items():
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    acc[r.get("label") or r["system"]][t][k].append(v)
    return {s: {t: {k: sum(v) / len(v) for k, v in d.items()} for t, d in ts.items()} for s, ts in acc.items()}


def render_orders(results: list[dict], a: str, b: str) -> str:
    """b / a per group in each order (a first, b first) and over both: an order bias shows as a gap."""
    by = collections.defaultdict(list)
    for i, r in enumerate(results):
        by[r.get("label") or r["system"]].append((r.get("run", i), r))
    if len(by.get(a, [])) < 2 or len(by.get(b, [])) < 2:
        return ""
    (ia1, a1), (ia2, a2) = sorted(by[a], key=lambda x: x[0])[:2]
    (ib1, b1), (ib2, b2) = sorted(by[b], key=lambda x: x[0])[:2]
    # the pair where a ran first, and the pair where b ran first
    first_a = (a1, b1) if ia1 < ib1 else (a2, b2)
    first_b = (a2, b2) if ia1 < ib1 else (a1, b1)
    lines = [f"| {b} / {a} | trace | {a} first | {b} first | both orders (means) |", "|---|---|---|---|---|"]
    means = mean_by_system(results)
    for t in a1["traces"]:
        for key in ("req_per_s", "wall_profiled_s", "gemm_s", "attention_s", "other_s", "idle_s"):
            ratios = [_ratio(pa["traces"][t][key], pb["traces"][t][key]) for pa, pb in (first_a, first_b)]
            lines.append(f"| {key} | {t} | {ratios[0]} | {ratios[1]} | "
                         f"{_ratio(means[a][t][key], means[b][t][key])} |")
    return "\n".join(lines)


def _ratio(va: float, vb: float) -> str:
    return f"{vb / va:.3f}" if va else "-"


def render_kernels(results: list[dict], top: int = 25) -> str:
    """Kernel by kernel, side by side: calls and seconds per system (mean over that system's runs)."""
    per: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0, 0]))
    systems: list[str] = []
    for r in results:
        s = r.get("label") or r["system"]
        if s not in systems:
            systems.append(s)
        for t, row in r["traces"].items():
            for name, sec, calls, grp in row.get("kernels", row.get("top", [])):
                cell = per[(t, name, grp)][s]
                cell[0] += sec
                cell[1] += calls
                cell[2] += 1
    lines = ["| trace | kernel | group | " + " | ".join(f"{s} calls | {s} s" for s in systems) + " |",
             "|---|---|---|" + "---|---|" * len(systems)]
    ranked = sorted(per.items(), key=lambda kv: -max(c[0] / c[2] for c in kv[1].values()))
    for (t, name, grp), cells in ranked[:top]:
        vals = []
        for s in systems:
            sec, calls, n = cells.get(s, (0.0, 0, 0))
            vals.append(f"{calls // n} | {sec / n:.4f}" if n else "- | -")
        lines.append(f"| {t} | {name[:70]} | {grp} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def render_roofline(results: list[dict]) -> str:
    """Per system and trace: FLOPs, roofline time at the peak, fraction reached (profiled round and plain burst)."""
    lines = ["| system | trace | PFLOP | computed tokens | roofline s @ TFLOP/s | wall s | fraction | "
             "achieved TFLOP/s |", "|---|---|---|---|---|---|---|---|"]
    for label, r, t in _runs(results):
        row = r["traces"][t]
        if "roofline" not in row:
            continue
        f, rf = row["flops"], row["roofline"]
        lines.append(f"| {label} | {t} | {f['flops'] / 1e15:.3f} | {f['computed_tokens']} | {rf['roofline_s']:.2f} "
                     f"@ {rf['peak_tflops']:.0f} | {row['wall_profiled_s']:.2f} | {rf['fraction']:.3f} | "
                     f"{rf['achieved_tflops']:.0f} |")
    return "\n".join(lines)
