"""The service's figures, from `flame_llm.serving.service.status()`: as Prometheus text (the front door's
/metrics) and as the rows `flame-llm status` prints. Per shard: queue depth, admitted and rejected requests,
running and waiting sequences, KV cache usage, prefix hit rate, requests per batch, payload bytes (decoded vs
on the wire), and histograms of admission wait, time to first token, time per output token and time at the
shard; the router's decisions (sticky, new, spill, moved); a client's batches and payload bytes; and, of each
HTTP server, its requests by route, method and status and their latency (HttpMetrics)."""
from __future__ import annotations

import asyncio
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from actors.metrics import LATENCY_BUCKETS_S

# router counter -> decision label (sticky: the prefix's owner served it)
DECISIONS = {"hit": "sticky", "new": "new", "spill": "spill", "moved": "moved", "round_robin": "round_robin"}
HISTOGRAMS = {"queue_s": ("flame_shard_queue_wait_seconds", "admission wait of a request at its shard"),
              "ttft_s": ("flame_shard_ttft_seconds", "time to first token in the engine"),
              "tpot_s": ("flame_shard_tpot_seconds", "time per output token after the first"),
              "e2e_s": ("flame_shard_request_seconds", "a request's time at its shard, arrival to result"),
              "batch_requests": ("flame_shard_batch_requests", "requests per batch a shard received")}


def shard_figures(s: dict) -> dict:
    """The figures of one shard's stats() (status()["shards"][k]) under their display names."""
    eng = s.get("engine", {})
    blocks = eng.get("num_blocks", 0)
    return {"queued": s["queued"], "inflight": s["inflight_requests"], "admitted": s["admitted"],
            "rejected": s["rejected"], "aborted": s.get("aborted", 0), "running": eng.get("num_running", 0),
            "waiting": eng.get("num_waiting", 0),
            "kv_usage": 1.0 - eng.get("num_free_blocks", 0) / blocks if blocks else 0.0,
            "hit_rate": s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0,
            "requests": s["requests"], "batches": s["batches"],
            "payload_raw": s.get("payload_raw_bytes", 0), "payload_wire": s.get("payload_wire_bytes", 0)}


def quantile(h: dict, q: float) -> float | None:
    """The bucket bound below which a fraction q of a histogram dict's observations lie (None when empty)."""
    total = h["count"]
    if not total:
        return None
    seen = 0
    for bound, n in zip([*h["buckets"], float("inf")], h["counts"]):
        seen += n
        if seen >= q * total:
            return bound
    return float("inf")



# engine stats() counters every shard exports as flame_shard_<name>_total: what can stall every stream of a shard
# (issue 18: kernels compiled after startup, long collector pauses, the host time of long eager launches, which the
# tokens of the step before each wait for), and where a step's time goes (issue 39: the scheduler's step counts and
# the step timeline's GPU busy/idle and host seconds, engine/step_timeline.py)
ENGINE_COUNTERS = (
    ("jit_compiles", "jit_compiles", "kernel variants compiled after startup"),
    ("gc_pauses_over_10ms", "gc_pauses_over_10ms", "collector pauses over 10 ms in the engine's process"),
    ("mixed_graph_steps", "mixed_graph_steps", "steps with prefill tokens replayed from a CUDA graph"),
    ("long_launches", "long_launches", "eager steps of 2,048+ tokens enqueued"),
    ("long_launch_s", "long_launch_seconds", "host seconds preparing and enqueueing those steps"),
    ("early_commits", "early_commits", "steps handed out before the long step after them was enqueued"),
    ("num_decode_steps", "decode_steps", "steps of decode rows only"),
    ("num_prefill_steps", "prefill_steps", "steps with prefill tokens (mixed steps included)"),
    ("num_mixed_steps", "mixed_steps", "steps with prefill tokens and decode rows"),
    ("num_prefill_tokens", "prefill_tokens", "prefill tokens computed"),
    ("num_decode_tokens", "decode_tokens", "decode tokens computed"),
    ("timeline_steps", "timeline_steps", "steps timed on the GPU"),
    ("gpu_busy_s", "gpu_busy_seconds", "GPU seconds from a step's first kernel to its last"),
    ("gpu_idle_s", "gpu_idle_seconds", "GPU seconds idle between steps while work was running"),
    ("gpu_idle_gaps", "gpu_idle_gaps", "idle gaps of 1 ms or more between steps (late launches)"),
    ("gpu_idle_gaps_s", "gpu_idle_gap_seconds", "GPU seconds in those gaps"),
    ("host_step_s", "host_step_seconds", "engine-thread seconds per step apart from waiting for the GPU"),
    ("sync_wait_s", "sync_wait_seconds", "engine-thread seconds waiting for a step's tokens"),
    *((f"{p}_{k}", f"{p}_{n}", f"{p.replace('_', ' ')} steps: {d}") for p in ("decode_graph", "mixed_graph", "eager")
      for k, n, d in (("timed_steps", "timed_steps", "steps timed"), ("gpu_s", "gpu_seconds", "GPU seconds"),
                      ("rows", "rows", "sequences they carried"))),
)

class _StatusCollector:
    def __init__(self, st: dict, client: dict | None) -> None:
        self.st, self.client = st, client

    def collect(self):
        up = GaugeMetricFamily("flame_shard_up", "1 when the shard answered", labels=["shard", "device"])
        gauges = {k: GaugeMetricFamily(f"flame_shard_{k}", doc, labels=["shard", "device"]) for k, doc in (
            ("queue_depth", "requests waiting for admission"), ("inflight_requests", "requests admitted"),
            ("running_sequences", "sequences the engine runs"), ("waiting_sequences", "sequences the engine queues"),
            ("kv_usage_ratio", "KV cache blocks in use"), ("prefix_hit_ratio", "prompt tokens served from cache"))}
        counters = {k: CounterMetricFamily(f"flame_shard_{k}", doc, labels=["shard", "device"]) for k, doc in (
            ("admitted", "requests admitted"), ("rejected", "requests rejected (overloaded)"),
            ("aborted", "requests aborted (their caller gave up or died)"), ("requests", "requests served"),
            ("batches", "request batches received"), ("prompt_tokens", "prompt tokens served"),
            ("cached_tokens", "prompt tokens served from the prefix cache"), ("output_tokens", "tokens generated"))}
        stalls = {k: CounterMetricFamily(f"flame_shard_{name}", doc, labels=["shard", "device"])
                  for k, name, doc in ENGINE_COUNTERS}
        payload = CounterMetricFamily("flame_shard_payload_bytes", "request payload bytes a shard received",
                                      labels=["shard", "device", "kind"])
        hists = {k: HistogramMetricFamily(name, doc, labels=["shard", "device"])
                 for k, (name, doc) in HISTOGRAMS.items()}
        for s in self.st["shards"]:
            labels = [str(s["shard"]), s.get("device", "")]
            up.add_metric(labels, 0.0 if "error" in s else 1.0)
            if "error" in s:
                continue
            f = shard_figures(s)
            for k, key in (("queue_depth", "queued"), ("inflight_requests", "inflight"),
                           ("running_sequences", "running"), ("waiting_sequences", "waiting"),
                           ("kv_usage_ratio", "kv_usage"), ("prefix_hit_ratio", "hit_rate")):
                gauges[k].add_metric(labels, float(f[key]))
            for k in counters:
                counters[k].add_metric(labels, float(s.get(k, 0)))
            eng = s.get("engine", {})
            for k in stalls:
                stalls[k].add_metric(labels, float(eng.get(k, 0)))
            payload.add_metric([*labels, "raw"], float(f["payload_raw"]))
            payload.add_metric([*labels, "wire"], float(f["payload_wire"]))
            for k, h in s.get("histograms", {}).items():
                if k in hists:
                    hists[k].add_metric(labels, _cumulative(h), h["sum"])
        yield from [up, *gauges.values(), *counters.values(), *stalls.values(), payload, *hists.values()]
        router = self.st["router"]
        decisions = CounterMetricFamily("flame_router_decisions", "routing decisions", labels=["decision"])
        for key, label in DECISIONS.items():
            decisions.add_metric([label], float(router["counters"].get(key, 0)))
        yield decisions
        yield GaugeMetricFamily("flame_router_prefixes", "prefix chain hashes the router remembers",
                                value=float(router["entries"]))
        yield CounterMetricFamily("flame_router_dropped", "prefixes dropped with a restarted or lost shard",
                                  value=float(router["counters"].get("dropped", 0)))
        if self.client is not None:
            c = self.client
            yield CounterMetricFamily("flame_client_batches", "batches this client sent", value=float(c["batches"]))
            yield CounterMetricFamily("flame_client_retries", "requests this client sent again",
                                      value=float(c["retries"]))
            yield CounterMetricFamily("flame_client_stream_resumes", "streams that went on from their last token "
                                      "after their shard died", value=float(c.get("stream_resumes", 0)))
            fam = CounterMetricFamily("flame_client_payload_bytes", "request payload bytes this client sent",
                                      labels=["kind"])
            fam.add_metric(["raw"], float(c["payload_raw_bytes"]))
            fam.add_metric(["wire"], float(c["payload_wire_bytes"]))
            yield fam


def _cumulative(h: dict) -> list[tuple[str, float]]:
    out, seen = [], 0
    for bound, n in zip([*h["buckets"], float("inf")], h["counts"]):
        seen += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(seen)))
    return out


def render_service(st: dict, client_counters: dict | None = None,
                   extra: CollectorRegistry | None = None) -> bytes:
    """Prometheus text of a status() dict (and a client's counters, and the collectors of `extra`)."""
    registry = CollectorRegistry()
    registry.register(_StatusCollector(st, client_counters))
    return generate_latest(registry) + (generate_latest(extra) if extra is not None else b"")


def render_engine(info: dict, engine_stats: dict, counters: dict) -> bytes:
    """Prometheus text of serve-http's one engine, in the shard metrics' names (shard "0")."""
    shard = {"shard": 0, "device": info["device"], "queued": engine_stats.get("num_queued", 0),
             "inflight_requests": engine_stats.get("num_in_flight", 0), "admitted": counters["requests"],
             "rejected": 0, "requests": counters["requests"], "batches": 0,
             "prompt_tokens": engine_stats.get("prefix_query_tokens", 0),
             "cached_tokens": engine_stats.get("prefix_hit_tokens", 0), "engine": engine_stats}
    return render_service({"shards": [shard], "router": {"counters": {}, "entries": 0}})


CLIENT_GONE = "499"  # the status label of a request whose client went away before its answer (nginx's)
# set on a request whose whole answer was written (a stream to its [DONE] and EOF): a client that closes the
# connection then, while the handler still cleans up, got its answer, and is counted with this status, not 499
ANSWERED = "flame_answered_status"


class HttpMetrics:
    """What an HTTP server answered: `flame_http_requests_total{route, method, status}` and
    `flame_http_request_duration_seconds{route}` (arrival to the end of the response, streams included). The route
    is the matched route's pattern ("unmatched" otherwise), so a scan of made-up paths adds no label values."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("flame_http_requests", "HTTP requests answered, by route, method and status",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("flame_http_request_duration_seconds", "HTTP request arrival to its response's end",
                                 ["route"], buckets=LATENCY_BUCKETS_S, registry=self.registry)

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """The outermost middleware: it sees the status the error middleware answered with."""
        t0 = time.perf_counter()
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        status = "500"
        try:
            response = await handler(request)
            status = str(response.status)
            return response
        except web.HTTPException as e:
            status = str(e.status)
            raise
        except (asyncio.CancelledError, ConnectionResetError):  # the client went away (before or after its answer)
            status = str(request.get(ANSWERED, CLIENT_GONE))
            raise
        finally:
            self.requests.labels(route, request.method, status).inc()
            self.latency.labels(route).observe(time.perf_counter() - t0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
