"""`flame-llm bench --mode load`: each system started fresh, a warmup stream, then one window per rate of
the document-QA Poisson stream (bench/loadgen.py), then stopped; one raw JSON per system, and the report:
a table per system and one chart of latency against offered load for every system.

    flame-llm bench --mode load --systems flame,engine,vllm --rates 0.5,1,2,4 --duration-s 60 --out DIR
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os

from tqdm import tqdm

from bench.loadgen import LOAD_FORMAT, LoadConfig, make_documents, run_rate, summarize
from bench.loadgen import record as load_record
from bench.runner import build_setup
from bench.systems import make_system, parse_system

log = logging.getLogger(__name__)


def load_config(a, vocab_size: int) -> LoadConfig:
    rates = tuple(float(r) for r in a.rates.split(",") if r.strip())
    return LoadConfig(rates=rates, duration_s=a.duration_s, drain_s=a.drain_s, num_docs=a.docs,
                      doc_tokens=a.doc_tokens, question_tokens=a.question_tokens, output_tokens=a.output_tokens,
                      vocab_size=vocab_size, seed=a.seed, slo_ttft_s=a.slo_ttft_s, slo_tpot_s=a.slo_tpot_s)


def run_system(label: str, o, cfg: LoadConfig, out_dir: str, warmup_requests: int) -> dict:
    """Start the system fresh, warm it up, run every rate's window, stop it; the raw record (also written)."""
    setup = build_setup(o, os.path.join(out_dir, "logs"))
    parsed = parse_system(label, o.policy)
    cfg = dataclasses.replace(cfg, policy=parsed.policy)  # the client's placement: "-rr" labels round-robin
    system = make_system(parsed, setup, f"load-{label}")
    info = system.start()
    try:
        replicas = system.http_replicas()
        docs = make_documents(cfg)
        warm = dataclasses.replace(cfg, rates=(cfg.rates[0],), duration_s=max(1.0, warmup_requests / cfg.rates[0]),
                                   seed=cfg.seed + 1)
        if warmup_requests:  # other documents (seed + 1): the measured windows' prefixes stay unseen
            asyncio.run(run_rate(replicas, warm, warm.rates[0], make_documents(warm), setup.model_revision))
        windows, outcomes = [], []
        for k, rate in enumerate(tqdm(cfg.rates, desc=f"{label} rates", unit="rate")):
            got = asyncio.run(run_rate(replicas, cfg, rate, docs, setup.model_revision, window_seed=k))
            outcomes.append(got)
            windows.append(summarize(got, rate, cfg))
            log.info("%s at %.2f req/s: %s", label, rate, {k: v for k, v in windows[-1].items()
                                                           if k in ("achieved_rps", "goodput_rps", "rejected")})
    finally:
        system.stop()
    rec = load_record(label, cfg, windows, outcomes, {k: v for k, v in info.items() if k != "health"})
    os.makedirs(os.path.join(out_dir, "raw"), exist_ok=True)
    with open(os.path.join(out_dir, "raw", f"load-{label}.json"), "w") as f:
        json.dump(rec, f)
    return rec


def render(records: list[dict]) -> str:
    """Markdown: per system one row per rate; every figure from the raw records."""
    if not records:
        return "no load records\n"
    cfg = records[0]["config"]
    lines = [f"# Sustained load: document-QA Poisson stream, {cfg['doc_tokens']}-token documents x "
             f"{cfg['num_docs']}, {cfg['question_tokens']}-token questions, {cfg['output_tokens']} output tokens; "
             f"{cfg['duration_s']:.0f} s per rate; SLO TTFT <= {cfg['slo_ttft_s']} s and TPOT <= "
             f"{cfg['slo_tpot_s'] * 1000:.0f} ms", ""]
    for rec in records:
        lines += [f"## {rec['system']} (saturation {rec['saturation_rps']:.3f} req/s)", "",
                  "| offered req/s | achieved req/s | goodput req/s | SLO met % | rejected | failed | TTFT p50 / p90 / "
                  "p99 (s) | TPOT p50 / p99 (ms) | ITL p99 (ms) | e2e p50 / p99 (s) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for w in rec["windows"]:
            t, p, i, e = w["ttft_s"], w["tpot_s"], w["itl_s"], w["e2e_s"]
            lines.append(f"| {w['offered_rps']:.2f} | {w['achieved_rps']:.3f} | {w['goodput_rps']:.3f} | "
                         f"{w['slo_met_pct']:.1f} | {w['rejected']} | {w['failed']} | {_trio(t)} | "
                         f"{_ms(p, 'p50')} / {_ms(p, 'p99')} | {_ms(i, 'p99')} | {_pair(e)} |")
        lines.append("")
    if len(records) > 1:
        subject = records[0]
        lines += ["| saturation ratio | value |", "|---|---|"]
        for rec in records[1:]:
            ratio = subject["saturation_rps"] / rec["saturation_rps"] if rec["saturation_rps"] else float("nan")
            lines.append(f"| {subject['system']} / {rec['system']} | {ratio:.4f} |")
        lines.append("")
    return "\n".join(lines)


def _trio(p: dict) -> str:
    return " / ".join(f"{p[k]:.3f}" for k in ("p50", "p90", "p99")) if p else "-"


def _pair(p: dict) -> str:
    return f"{p['p50']:.3f} / {p['p99']:.3f}" if p else "-"


def _ms(p: dict, k: str) -> str:
    return f"{1000 * p[k]:.1f}" if p else "-"


def plot(records: list[dict], path: str) -> bool:
    """Latency (TTFT and e2e, p50 and p99) and throughput against offered load, every system on one chart, one
    colour each; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    top = 0.0
    for k, rec in enumerate(records):
        c = f"C{k}"  # one colour per system in every panel; p99 dashed, achieved dotted
        ws = [w for w in rec["windows"] if w["ttft_s"]]
        x = [w["offered_rps"] for w in ws]
        axes[0].plot(x, [w["ttft_s"]["p50"] for w in ws], "o-", color=c, label=f"{rec['system']} p50")
        axes[0].plot(x, [w["ttft_s"]["p99"] for w in ws], "o--", color=c, label=f"{rec['system']} p99")
        top = max([top, *(w["ttft_s"]["p99"] for w in ws)])
        axes[1].plot(x, [w["e2e_s"]["p50"] for w in ws], "o-", color=c, label=f"{rec['system']} p50")
        axes[1].plot(x, [w["e2e_s"]["p99"] for w in ws], "o--", color=c, label=f"{rec['system']} p99")
        offered = [w["offered_rps"] for w in rec["windows"]]
        axes[2].plot(offered, [w["goodput_rps"] for w in rec["windows"]], "o-", color=c,
                     label=f"{rec['system']} goodput")
        axes[2].plot(offered, [w["achieved_rps"] for w in rec["windows"]], "x:", color=c,
                     label=f"{rec['system']} achieved")
    if records:
        slo = records[0]["config"]["slo_ttft_s"]
        if slo <= 2 * top:  # the SLO line only where it does not flatten the curves
            axes[0].axhline(slo, color="grey", lw=0.8, ls=":", label=f"SLO {slo} s")
        else:
            axes[0].set_title(f"time to first token (SLO {slo} s, off the scale)")
    for ax, title, ylabel in ((axes[0], "time to first token", "s"), (axes[1], "end-to-end latency", "s"),
                              (axes[2], "throughput", "req/s")):
        if not ax.get_title():
            ax.set_title(title)
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_load_report(out_dir: str, records: list[dict]) -> str:
    md = render(records)
    with open(os.path.join(out_dir, "load-report.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, "load-report.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "outcomes"} for r in records], f, indent=1)
    plot(records, os.path.join(out_dir, "load-report.png"))
    return md


def load_records(out_dir: str) -> list[dict]:
    raw = os.path.join(out_dir, "raw")
    recs = []
    for name in sorted(os.listdir(raw)) if os.path.isdir(raw) else []:
        if name.startswith("load-") and name.endswith(".json"):
            with open(os.path.join(raw, name)) as f:
                rec = json.load(f)
            if rec.get("format") == LOAD_FORMAT:
                recs.append(rec)
    return recs
