"""What could stall a load window, read around it (issue 18 item 3): the engines' own counters of kernel variants
compiled just in time and garbage-collection pauses over 10 ms (the engine's stats(): flame's shards through
their stats(), our serve-http through /metrics when it exports them; absent counters read as None and the report
prints n/a), and this process's own GC pauses (gc.callbacks: the load generator and flame's Python client).
Also the systems' KV capacity in tokens (the eviction workload states it beside the distinct document tokens)."""
from __future__ import annotations

import logging
import re
import urllib.request

from flame_llm.engine.stalls import GcPauses
from flame_llm.serving.metrics import ENGINE_COUNTERS

log = logging.getLogger(__name__)

# where a window's tokens went (issue 39): engine steps and the tokens they carried (flame: its scheduler's counts
# and schedule-to-complete seconds of decode-only and prefill/mixed steps; vLLM: its iteration_tokens histogram)
STEP_KEYS = ("num_steps", "step_tokens", "num_decode_steps", "num_mixed_steps", "num_prefill_tokens",
             "num_decode_tokens", "decode_time_s", "prefill_time_s", "mixed_graph_steps")
# the step timeline (engine/step_timeline.py): GPU busy and idle seconds between steps, the engine thread's host
# seconds apart from its waits, and GPU seconds per step path (a late launch vs a slower step under load)
TIMELINE_KEYS = tuple(k for k, _, _ in ENGINE_COUNTERS if k not in STEP_KEYS and k not in (
    "jit_compiles", "gc_pauses_over_10ms", "long_launches", "long_launch_s", "early_commits", "num_prefill_steps"))
VLLM_STEPS = {"vllm:iteration_tokens_total_count": "num_steps", "vllm:iteration_tokens_total_sum": "step_tokens"}
# engine stats() keys: kernel variants compiled after warmup (any kernel; attention's alone on older engines),
# GC pauses over 10 ms and the longest pause so far
# and the long eager launches (count, host seconds) with the hand-outs emit_before_long_launch moved before them
COUNT_KEYS = ("jit_compiles", "attention_jit_compiles", "gc_pauses_over_10ms", "long_launches", "long_launch_s",
              "early_commits", *STEP_KEYS, *TIMELINE_KEYS)
MAX_KEYS = ("gc_pause_max_s",)


class GcWatch(GcPauses):
    """This process's collections that paused it longer than `threshold_s`, while entered (the engine's counter,
    read as a load window's figures)."""

    def figures(self) -> dict:
        return {"gc_pauses_over_10ms": self.num_over, "gc_pause_max_s": self.max_s, "collections": self.collections}


def merge(stats: list[dict]) -> dict:
    """One system's counters from its engines' stats dicts: counts summed, maxima maxed, None when no engine
    reports the key."""
    out: dict = {}
    for k in COUNT_KEYS + MAX_KEYS:
        vals = [s[k] for s in stats if isinstance(s.get(k), (int, float))]
        out[k] = (max(vals) if k in MAX_KEYS else sum(vals)) if vals else None
    return out


def parse_metrics(text: str) -> dict:
    """Engine counters from Prometheus text: a sample whose name (less `_total`) ends with a stats key (or with
    gc_pause_max_seconds) counts as that key; counts summed over labels, the pause maximum maxed."""
    suffixes = (("attention_jit_compiles", "attention_jit_compiles"), ("jit_compiles", "jit_compiles"),
                ("gc_pauses_over_10ms", "gc_pauses_over_10ms"), ("gc_pause_max_s", "gc_pause_max_s"),
                ("gc_pause_max_seconds", "gc_pause_max_s"), ("long_launches", "long_launches"),
                ("long_launch_seconds", "long_launch_s"), ("early_commits", "early_commits"))
    shard_names = {f"flame_shard_{name}": key for key, name, _ in ENGINE_COUNTERS}
    found: dict = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name = m.group(1).removesuffix("_total")
        key = shard_names.get(name) or next((k for suffix, k in suffixes if name.endswith(suffix)), None)
        if key is None:
            continue
        v = float(m.group(3))
        found[key] = max(found.get(key, v), v) if key in MAX_KEYS else found.get(key, 0.0) + v
    return found


def vllm_steps(text: str) -> dict:
    """vLLM's engine steps and the tokens they carried, from its /metrics (summed over labels)."""
    found: dict = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1) in VLLM_STEPS:
            key = VLLM_STEPS[m.group(1)]
            found[key] = found.get(key, 0.0) + float(m.group(3))
    return found


def _get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode(errors="replace")


def stream_resumes(system) -> int | None:
    """How many streams flame's front door resumed after their shard died (its client's counter, from its
    /metrics: the SSE stream itself does not say), or None (not flame, or the door did not answer)."""
    if system.system.kind != "flame":
        return None
    try:
        text = _get(f"{system.http_replicas()[0].url}/metrics")
    except OSError as e:
        log.warning("could not read the front door's /metrics: %s", e)
        return None
    m = re.search(r"^flame_client_stream_resumes_total\s+(\S+)", text, re.M)
    return int(float(m.group(1))) if m else None


def engine_stats(system) -> list[dict] | None:
    """Each engine's stats as a dict (flame: every shard's stats()["engine"]; our serve-http: what its /metrics
    says; vLLM: its steps only, from /metrics)."""
    kind = system.system.kind
    if kind == "flame":
        import ray
        return _with_totals([s.get("engine", {}) for s in ray.get([a.stats.remote()
                                                                   for a in system.service.actors.values()])])
    if kind == "vllm":
        return [vllm_steps(_get(f"{r.url}/metrics")) for r in system.http_replicas()]
    if kind == "engine":
        out = []
        for r in system.http_replicas():
            try:
                out.append(parse_metrics(_get(f"{r.url}/metrics")))
            except OSError as e:
                log.warning("could not read %s/metrics: %s", r.url, e)
                out.append({})
        return _with_totals(out)
    return None


def _with_totals(stats: list[dict]) -> list[dict]:
    """Our engines' step totals (vLLM's histogram gives them as they are) from their decode and prefill steps."""
    for e in stats:
        if "num_decode_steps" in e:
            e["num_steps"] = e["num_decode_steps"] + e.get("num_prefill_steps", 0)
            e["step_tokens"] = e.get("num_decode_tokens", 0) + e.get("num_prefill_tokens", 0)
    return stats


def stall_counters(system) -> dict | None:
    try:
        stats = engine_stats(system)
    except Exception as e:  # noqa: BLE001 - the figures are n/a, the window stands
        log.warning("could not read the engines' stall counters: %s", e)
        return None
    return None if stats is None else merge(stats)


def window_stalls(before: dict | None, after: dict | None, client: dict) -> dict:
    """A window's stall figures: the engines' counters over the window (None: not reported) and the client's."""
    eng: dict = {}
    for k in COUNT_KEYS:
        b, a = (before or {}).get(k), (after or {}).get(k)
        eng[k] = a - b if a is not None and b is not None and a >= b else None  # a < b: a restart reset it
    b, a = (before or {}).get("gc_pause_max_s"), (after or {}).get("gc_pause_max_s")
    # the engines' longest pause so far: it happened in this window only when it grew
    eng["gc_pause_max_s"] = a if a is not None and b is not None and a > b else (0.0 if a is not None else None)
    return {"engine": eng, "client": client}


def kv_capacity_tokens(system, block_size: int) -> int | None:
    """The KV cache of every engine together, in tokens (None when the system does not say)."""
    kind = system.system.kind
    try:
        if kind == "flame":
            stats = engine_stats(system) or []
            return sum(int(s.get("num_blocks", 0)) for s in stats) * block_size if stats else None
        if kind == "vllm":
            total = 0
            for r in system.http_replicas():
                m = re.search(r'vllm:cache_config_info\{([^}]*)\}', _get(f"{r.url}/metrics"))
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) if m else {}
                if "num_gpu_blocks" not in labels:
                    return None
                total += int(labels["num_gpu_blocks"]) * int(labels.get("block_size", 16))
            return total
    except Exception as e:  # noqa: BLE001 - unknown, the report says so
        log.warning("could not read the KV capacity: %s", e)
    return None  # serve-http does not publish its block count


# prefix-cache counters around a window: flame's engine stats keys, and the /metrics samples (less `_total`) of
# serve-http (its shard-metric names) and vLLM (v1 names), summed over replicas
CACHE_METRICS = {"engine": {"prefix_hit_tokens": "flame_shard_cached_tokens",
                            "prefix_query_tokens": "flame_shard_prompt_tokens"},
                 "vllm": {"prefix_hit_tokens": "vllm:prefix_cache_hits",
                          "prefix_query_tokens": "vllm:prefix_cache_queries"}}


def cache_counters(system) -> dict | None:
    """Prompt tokens looked up in the prefix cache, those found, and (flame) cached blocks evicted, over every
    engine of the system so far; None when they cannot be read."""
    kind = system.system.kind
    try:
        if kind == "flame":
            stats = engine_stats(system) or []
            return {k: sum(int(s.get(k, 0)) for s in stats)
                    for k in ("prefix_hit_tokens", "prefix_query_tokens", "evictions")}
        names = CACHE_METRICS.get(kind)
        if names is None:
            return None
        out = {k: 0.0 for k in names}
        for r in system.http_replicas():
            for line in _get(f"{r.url}/metrics").splitlines():
                m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
                if m:
                    for key, name in names.items():
                        if m.group(1).removesuffix("_total") == name:
                            out[key] += float(m.group(3))
        return out
    except Exception as e:  # noqa: BLE001 - the figures are n/a, the window stands
        log.warning("could not read the prefix-cache counters: %s", e)
        return None


def window_cache(before: dict | None, after: dict | None) -> dict | None:
    """The window's prefix-cache figures: tokens looked up and found, hit rate, evictions (None: unknown)."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in after if k in before}
    if any(v < 0 for v in d.values()):  # an engine restarted in the window: its counters began again
        return None
    q = d.get("prefix_query_tokens", 0)
    return {**d, "hit_rate": d.get("prefix_hit_tokens", 0) / q if q else None}


def shared_pauses(outcomes: list, min_gap_s: float = 0.5, tol_s: float = 0.02) -> list[dict]:
    """Pauses that several streams sat through together: gaps of at least min_gap_s before a token (the first
    token's wait included) whose ends fall within tol_s of each other. Streams of one engine get their tokens
    from the same steps, so a pause they share ended with one slow engine step (a JIT compile, a GC pause, a long
    prefill), not in a stream's own path. Each: when it ended (seconds into the window), the longest gap ending
    there, how many streams it held, and `pause_s`: the shortest of their gaps (they all waited at least that
    long together) beside `longest_wait_s`."""
    ends = []
    for o in outcomes:
        prev = 0.0
        for t in o.chunk_s:
            if t - prev >= min_gap_s:
                ends.append((o.sent_s + t, t - prev))
            prev = t
    ends.sort()
    out: list[dict] = []
    for end, gap in ends:
        if out and end - out[-1]["end_s"] <= tol_s:
            out[-1]["streams"] += 1
            out[-1]["pause_s"] = min(out[-1]["pause_s"], gap)
            out[-1]["longest_wait_s"] = max(out[-1]["longest_wait_s"], gap)
        else:
            out.append({"end_s": end, "pause_s": gap, "longest_wait_s": gap, "streams": 1})
    return [p for p in out if p["streams"] >= 2]
