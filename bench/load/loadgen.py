"""Sustained load: the seed's document-QA mix as a Poisson stream at a series of rates, against any
OpenAI-compatible completions endpoint that streams (the flame front door, our serve-http, `vllm serve`).

Each rate runs for a fixed duration: requests are released at exponential inter-arrival times (seeded),
each streams its tokens (`stream: true`), and the stream is timed on arrival of every chunk. A request is
placed on its replica by the same sticky-prefix policy as the burst client (the router's own policy over
the one prefix chain), so a document's questions meet their cached prefix. Nothing is sent after the
window closes; requests still running are awaited (bounded by `drain_s`) and counted.

Per rate: offered and achieved throughput, TTFT / TPOT / ITL / end-to-end percentiles, rejected and failed
requests, and goodput: completed requests per second that met the SLO (TTFT and TPOT bounds). A window is
saturated when its completions fall behind its arrivals: served < sat_fraction x the arrival rate it really
drew, where served counts completions over the window shifted by their median latency. A series without a
saturated window says so (`saturation`). The stream's workload options (answer length distribution, Zipf-skewed
documents) are in bench/load/load_workloads.py."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np

from bench.burst.traces import TraceConfig
from bench.http_client import SERVED_MODEL_NAME, Replica, sse_chunks
from bench.load.load_workloads import DEFAULT_OUTPUT_LEN, OutputLen, doc_weights, draw_doc
from flame_llm.protocol.routing_key import estimate_prefill_work, prefix_chain
from router.policy import RouterConfig, RouterPolicy

LOAD_FORMAT = "flame-load-raw/2"  # the raw record of one system's series (/1: before saturation and stalls)


_T = TraceConfig()
# MLPerf Inference's interactive bounds for Llama-class chat (TTFT <= 0.5 s, TPOT <= 30 ms): every window's goodput is
# also counted under these fixed bounds (`interactive_rps`), whatever --slo-ttft-s / --slo-tpot-s say, so reports of
# different calls compare on one bar
INTERACTIVE_TTFT_S = 0.5
INTERACTIVE_TPOT_S = 0.030


@dataclass(slots=True)
class LoadConfig:
    rates: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)  # offered requests per second, one window each
    duration_s: float = 60.0  # of each window (arrivals stop at its end)
    drain_s: float = 120.0  # how long requests still running at the window's end may take
    num_docs: int = _T.num_docs  # documents of the mix (the seed's traces'); a request asks about one, uniformly
    doc_tokens: int = _T.doc_tokens
    question_tokens: int = _T.question_tokens
    output_tokens: int = _T.output_tokens
    vocab_size: int = _T.vocab_size
    seed: int = _T.seed
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    policy: str = "cumulative"  # placement over several replicas ("round_robin": the affinity A/B)
    # answer lengths: a preset (load_workloads.PRESETS: "qa" lognormal 32-512, "long" 64-1024), N, uniform:LO-HI,
    # lognormal:LO-HI, or "fixed" / "" (output_tokens each: the seed's 16, which hides decode)
    output_len: str = DEFAULT_OUTPUT_LEN
    doc_zipf: float = 0.0  # document popularity: 0 uniform, S > 0 Zipf with exponent S (hot prefixes)
    sat_fraction: float = 0.95  # a window is saturated when served < this x its arrival rate (summarize)
    slo_target_pct: float = 90.0  # the auto search's latency bound: at least this % of requests meet the SLO
    kill_shard_at_s: float | None = None  # flame: kill one engine actor this many seconds into each window

    def __post_init__(self) -> None:
        checks = [("rates", len(self.rates) > 0 and all(r > 0 for r in self.rates), "positive numbers"),
                  ("duration_s", self.duration_s > 0, "> 0"), ("drain_s", self.drain_s >= 0, ">= 0"),
                  ("num_docs", self.num_docs >= 1, ">= 1"), ("doc_tokens", self.doc_tokens >= 1, ">= 1"),
                  ("question_tokens", self.question_tokens >= 1, ">= 1"),
                  ("output_tokens", self.output_tokens >= 1, ">= 1"), ("vocab_size", self.vocab_size >= 4, ">= 4"),
                  ("slo_ttft_s", self.slo_ttft_s > 0, "> 0"), ("slo_tpot_s", self.slo_tpot_s > 0, "> 0"),
                  ("doc_zipf", self.doc_zipf >= 0, ">= 0"), ("sat_fraction", 0 < self.sat_fraction <= 1, "in (0, 1]"),
                  ("slo_target_pct", 0 <= self.slo_target_pct <= 100, "in [0, 100]"),
                  ("kill_shard_at_s", self.kill_shard_at_s is None or 0 <= self.kill_shard_at_s < self.duration_s,
                   "in [0, duration_s)")]
        for name, ok, limit in checks:
            if not ok:
                raise ValueError(f"load field {name!r} must be {limit}; got {getattr(self, name)!r}")
        self.lengths()  # a bad spec fails here

    def lengths(self) -> OutputLen:
        if self.output_len.strip() in ("", "fixed"):
            return OutputLen("fixed", self.output_tokens, self.output_tokens)
        return OutputLen.parse(self.output_len)


@dataclass(slots=True)
class Outcome:
    """One request: times in seconds from its release; error is None when it completed."""
    sent_s: float
    doc: int
    replica: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # arrival of every chunk that carried tokens
    output_tokens: int = 0
    status: int = 0
    error: str | None = None
    max_tokens: int = 0  # the answer length asked for


def make_documents(cfg: LoadConfig) -> np.ndarray:
    rng = np.random.default_rng(cfg.seed)
    return rng.integers(0, cfg.vocab_size, size=(cfg.num_docs, cfg.doc_tokens), dtype=np.int64)


def answer_rng(cfg: LoadConfig, window_seed: int = 0) -> np.random.Generator:
    """The answer lengths' own seeded stream (cfg.lengths().draw): the prompts stay the same whatever the lengths."""
    return np.random.default_rng(cfg.seed * 1_000_033 + window_seed)


def arrivals(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """Release times in [0, duration_s) of a Poisson stream of `rate` per second."""
    rng = np.random.default_rng(seed)
    n = int(rate * duration_s * 2 + 20)
    times = np.cumsum(rng.exponential(1.0 / rate, size=n))
    while times[-1] < duration_s:  # very unlikely: draw more
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, size=n))])
    return times[times < duration_s]


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                     out: Outcome, t0: float, model: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for chunk in sse_chunks(resp):
                if "error" in chunk:
                    out.error = str(chunk["error"])[:200]
                    return
                n = _chunk_tokens(chunk)
                if n:
                    now = time.perf_counter() - t0
                    out.chunk_s.append(now)
                    out.output_tokens += n
                    if out.ttft_s is None:
                        out.ttft_s = now
        out.e2e_s = time.perf_counter() - t0
        if out.output_tokens == 0:
            out.error = "the stream carried no tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"[:200]


def _chunk_tokens(chunk: dict) -> int:
    """Tokens a streamed completion chunk carries: its token ids when given, else one per non-empty text."""
    n = 0
    for c in chunk.get("choices") or []:
        ids = c.get("token_ids")
        n += len(ids) if ids is not None else (1 if c.get("text") else 0)
    return n


async def run_rate(replicas: list[Replica], cfg: LoadConfig, rate: float, docs: np.ndarray, model_revision: str,
                   model: str = SERVED_MODEL_NAME, window_seed: int = 0, event=None) -> list[Outcome]:
    """One window at `rate`: every release on time, each request streamed; the outcomes in release order.
    `event`: (seconds into the window, a blocking function, a dict) the function is run in a thread at that time
    (the shard kill), the dict gets `at_s`, when it started."""
    rng = np.random.default_rng(cfg.seed * 1_000_003 + window_seed)
    len_rng = answer_rng(cfg, window_seed)
    lengths, weights = cfg.lengths(), doc_weights(cfg.num_docs, cfg.doc_zipf)
    times = arrivals(rate, cfg.duration_s, cfg.seed * 7919 + window_seed)
    policy = RouterPolicy(len(replicas), RouterConfig(cfg.policy))
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
    timeout = aiohttp.ClientTimeout(total=cfg.duration_s + cfg.drain_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks, outcomes, fired = [], [], None
        t0 = time.perf_counter()
        if event is not None:
            async def fire(at_s: float, fn, sink: dict) -> None:
                await asyncio.sleep(max(0.0, at_s - (time.perf_counter() - t0)))
                sink["at_s"] = time.perf_counter() - t0
                await asyncio.to_thread(fn)

            fired = asyncio.ensure_future(fire(*event))
            tasks.append(fired)
        for t in times:
            delay = t - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            d = draw_doc(rng, weights)
            prompt = np.concatenate([docs[d], rng.integers(0, cfg.vocab_size, cfg.question_tokens)]).tolist()
            n_out = lengths.draw(len_rng)
            work = estimate_prefill_work(len(prompt))
            (k,) = policy.route_batch([(prefix_chain(prompt, model_revision), work, n_out)])
            sent = time.perf_counter()
            out = Outcome(sent - t0, d, k, max_tokens=n_out)
            outcomes.append(out)
            task = asyncio.ensure_future(stream_one(session, replicas[k].url, prompt, n_out, out, sent, model))
            # the policy's outstanding work leaves with the request (load_guarded places by it)
            task.add_done_callback(lambda _, k=k, work=work, n=n_out: policy.complete(k, work, n, 0, 0))
            tasks.append(task)
        done, pending = await asyncio.wait(tasks, timeout=cfg.drain_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        for out in outcomes:
            if out.e2e_s is None and out.error is None:
                out.error = f"still running {cfg.drain_s}s after the window closed"
        if fired is not None and fired.done() and not fired.cancelled() and fired.exception() is not None:
            # a window whose event (the shard kill) failed did not run the workload it was asked for
            raise RuntimeError(f"the window's event failed: {fired.exception()!r}") from fired.exception()
    return outcomes


def summarize(outcomes: list[Outcome], rate: float, cfg: LoadConfig) -> dict:
    """The window's figures, all from its outcomes."""
    ok = [o for o in outcomes if o.error is None]
    span = max([cfg.duration_s] + [o.sent_s + o.e2e_s for o in ok])  # until the last completion
    tpot = [(o.e2e_s - o.ttft_s) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    itl = [b - a for o in ok for a, b in zip(o.chunk_s, o.chunk_s[1:])]
    good = met_slo(ok, cfg.slo_ttft_s, cfg.slo_tpot_s)
    interactive = met_slo(ok, INTERACTIVE_TTFT_S, INTERACTIVE_TPOT_S)
    rejected = [o for o in outcomes if o.status in (413, 429, 503)]
    arrival = len(outcomes) / cfg.duration_s  # the rate the Poisson draw really offered in this window
    achieved = len(ok) / span
    # completions over the window shifted by the median latency: a system that keeps up serves its arrivals in
    # the window's length, however long each request takes; one that falls behind needs longer (its backlog)
    e2e_p50 = float(np.percentile([o.e2e_s for o in ok], 50)) if ok else 0.0
    served = len(ok) / max(cfg.duration_s, span - e2e_p50)
    return {"offered_rps": rate, "sent": len(outcomes), "completed": len(ok), "rejected": len(rejected),
            "failed": len(outcomes) - len(ok) - len(rejected), "window_s": cfg.duration_s, "span_s": span,
            "arrival_rps": arrival, "achieved_rps": achieved, "served_rps": served,
            "saturated": bool(outcomes) and served < cfg.sat_fraction * arrival,
            "output_tok_s": sum(o.output_tokens for o in ok) / span,
            "goodput_rps": len(good) / span, "slo_met_pct": 100.0 * len(good) / len(outcomes) if outcomes else 0.0,
            "interactive_rps": len(interactive) / span,
            "interactive_met_pct": 100.0 * len(interactive) / len(outcomes) if outcomes else 0.0,
            "ttft_s": percentiles([o.ttft_s for o in ok]), "tpot_s": percentiles(tpot), "itl_s": percentiles(itl),
            "e2e_s": percentiles([o.e2e_s for o in ok]),
            "asked_tokens": percentiles([o.max_tokens for o in outcomes]),
            "short_answers": sum(o.output_tokens != o.max_tokens for o in ok),  # ignore_eos: each gets what it asked
            "errors": sorted({o.error for o in outcomes if o.error})[:5]}


def met_slo(ok: list[Outcome], ttft_s: float, tpot_s: float) -> list[Outcome]:
    """The completed requests whose first token came within ttft_s and whose later tokens averaged <= tpot_s."""
    return [o for o in ok if o.ttft_s <= ttft_s
            and (o.output_tokens <= 1 or (o.e2e_s - o.ttft_s) / (o.output_tokens - 1) <= tpot_s)]


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    a = np.asarray(xs, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "n": int(a.size)}


def saturation(windows: list[dict]) -> dict:
    """Where the series saturated, if it did: the knee is the lowest offered rate from which every window (it
    and all higher ones) fell behind its arrivals (`knee_offered_rps`, None when the highest did not); a
    saturated window below a rate the system kept up with is listed apart (`anomalies`: a stall or noise, not
    capacity). `saturation_rps` (the system's capacity) is the highest achieved throughput of a window at or
    past the knee, and None when there is no knee: the capacity is then above the highest offered rate, not the
    highest achieved throughput."""
    ws = sorted(windows, key=lambda w: w["offered_rps"])
    k = len(ws)
    while k > 0 and ws[k - 1]["saturated"]:
        k -= 1
    past = ws[k:]
    return {"saturated": bool(past), "knee_offered_rps": past[0]["offered_rps"] if past else None,
            "max_unsaturated_offered_rps": ws[k - 1]["offered_rps"] if k > 0 else None,
            "max_offered_rps": ws[-1]["offered_rps"] if ws else None,
            "max_achieved_rps": max((w["achieved_rps"] for w in ws), default=0.0),
            "saturation_rps": max(w["achieved_rps"] for w in past) if past else None,
            "anomalies": [w["offered_rps"] for w in ws[:k] if w["saturated"]]}


def record(system: str, cfg: LoadConfig, windows: list[dict], outcomes: list[list[Outcome]], info: dict) -> dict:
    """The raw record of one system's series: config, per-window summaries and every request's outcome."""
    sat = saturation(windows)
    return {"format": LOAD_FORMAT, "system": system, "config": asdict(cfg), "info": info,
            "windows": windows, "saturation": sat, "saturation_rps": sat["saturation_rps"],
            "outcomes": [[asdict(o) for o in window] for window in outcomes]}
