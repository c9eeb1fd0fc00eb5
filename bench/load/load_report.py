"""The load report from the raw records (bench/load/mode.py writes them): per system where it saturated (or that no
offered rate did), its startup time, the workload, one row per window with what could have stalled it, the
shard kill's effect when there was one; the capacity ratio only between systems that both saturated; one chart
of latency and throughput against offered load for every system."""
from __future__ import annotations

import json
import os

from bench.load.loadgen import (
    INTERACTIVE_TPOT_S,
    INTERACTIVE_TTFT_S,
    LOAD_FORMAT,
    LoadConfig,
    Outcome,
    saturation,
    summarize,
)
from bench.load.long_gaps import window_gaps
from bench.provenance import read_json

LOAD_FORMATS = ("flame-load-raw/1", LOAD_FORMAT)


def _config(c: dict) -> LoadConfig:
    """A record's config; one written before answer lengths were drawn (no `output_len`) asked output_tokens each."""
    fields = LoadConfig.__dataclass_fields__
    return LoadConfig(**{k: tuple(v) if k == "rates" else v for k, v in {"output_len": "", **c}.items()
                         if k in fields})


def upgrade(rec: dict) -> dict:
    """A record written before the saturation or interactive-goodput figures (format /1, or /2 without `served_rps`
    or `interactive_rps`) with its windows' figures recomputed from its outcomes (what else a window holds, stalls
    and kills, stays)."""
    if rec["format"] == LOAD_FORMAT and all("served_rps" in w and "interactive_rps" in w for w in rec["windows"]):
        sat = saturation(rec["windows"])  # derived from the windows: always by the rule of this code
        return {**rec, "saturation": sat, "saturation_rps": sat["saturation_rps"]}
    cfg = _config(rec["config"])
    fields = Outcome.__dataclass_fields__
    windows = [{**w, **summarize([Outcome(**{k: v for k, v in o.items() if k in fields}) for o in raw],
                                 w["offered_rps"], cfg)} for w, raw in zip(rec["windows"], rec["outcomes"])]
    sat = saturation(windows)
    return {**rec, "format": LOAD_FORMAT, "upgraded_from": rec["format"], "windows": windows,
            "saturation": sat, "saturation_rps": sat["saturation_rps"]}


def saturation_line(rec: dict) -> str:
    """One sentence: where the system saturated, or plainly that no offered rate did."""
    s, frac = rec["saturation"], rec["config"].get("sat_fraction", 0.95)
    odd = s.get("anomalies") or []
    note = (f" Windows at {', '.join(f'{r:.2f}' for r in odd)} req/s fell behind although a higher rate kept up: "
            "a stall or noise, not capacity." if odd else "")
    if not s["saturated"]:
        return (f"**No offered rate saturated {rec['system']}**: completions kept up with arrivals (served >= "
                f"{frac:.0%} of the arrival rate) at the highest rate offered, {s['max_offered_rps']:.2f} req/s "
                f"(highest achieved {s['max_achieved_rps']:.3f} req/s). Its capacity is above "
                f"{s['max_offered_rps']:.2f} req/s; this series does not measure it." + note)
    kept = s["max_unsaturated_offered_rps"]
    return (f"**Saturated at {s['knee_offered_rps']:.2f} req/s offered** (served < {frac:.0%} of arrivals); "
            + (f"highest offered rate it kept up with: {kept:.2f} req/s; " if kept is not None else
               "it fell behind at every offered rate; ")
            + f"capacity {s['saturation_rps']:.3f} req/s (highest achieved throughput of a saturated window)." + note)


def _workload(rec: dict) -> list[str]:
    c = rec["config"]
    out = []
    lens = _config(c).lengths()
    asked = [o.get("max_tokens", 0) for win in rec.get("outcomes", []) for o in win]
    if lens.dist != "fixed":
        out.append(f"answer lengths {lens.spec()} (seeded; asked p50 {_pct(asked, 50):.0f}, "
                   f"p99 {_pct(asked, 99):.0f}, max {max(asked, default=0)} tokens)")
    if c.get("doc_zipf"):
        from bench.load.load_workloads import hot_share
        docs = [o["doc"] for win in rec.get("outcomes", []) for o in win]
        out.append(f"documents Zipf s={c['doc_zipf']:g}: the most asked document drew "
                   f"{100 * hot_share(docs):.1f}% of requests, the top 10% of documents "
                   f"{100 * hot_share(docs, max(1, c['num_docs'] // 10)):.1f}%")
    kv = rec.get("kv") or {}
    if kv:
        cap = kv.get("kv_capacity_tokens")
        ratio = f" ({kv['distinct_doc_tokens'] / cap:.2f}x the cache: it must evict)" if cap and \
            kv["distinct_doc_tokens"] > cap else ""
        out.append(f"KV capacity {cap if cap is not None else 'n/a (not published)'} tokens over all engines vs "
                   f"{kv['distinct_doc_tokens']} distinct document tokens{ratio}")
    st = rec.get("startup")
    if st:
        out.append(f"startup: {st['first_answer_s']:.2f} s from start to the first answered request "
                   f"(system start {st['start_s']:.2f} s)")
    return out


def _pct(xs: list[float], q: float) -> float:
    import numpy as np
    return float(np.percentile(xs, q)) if xs else 0.0


def _stalls(w: dict) -> str:
    st = w.get("stalls")
    if not st:
        return "n/a"
    e, c = st["engine"], st["client"]

    def n(k: str) -> str:
        return "n/a" if e.get(k) is None else f"{e[k]:.0f}"

    jit = n("jit_compiles") if e.get("jit_compiles") is not None else \
        (f"{n('attention_jit_compiles')} (attn)" if e.get("attention_jit_compiles") is not None else "n/a")
    gmax = f" (max {1e3 * e['gc_pause_max_s']:.0f} ms)" if e.get("gc_pause_max_s") else ""
    return (f"{jit} / {n('gc_pauses_over_10ms')}{gmax} / {c['gc_pauses_over_10ms']}"
            + (f" (max {1e3 * c['gc_pause_max_s']:.0f} ms)" if c["gc_pauses_over_10ms"] else ""))


def _cache(w: dict) -> str:
    c = w.get("cache")
    if not c or c.get("hit_rate") is None:
        return "n/a"
    ev = f" ({c['evictions']:.0f})" if c.get("evictions") is not None else ""
    return f"{100 * c['hit_rate']:.1f}{ev}"


def _pauses(rec: dict) -> list[str]:
    """Per window, the pauses of >= 0.5 s that several streams sat through together (bench/load/load_stalls.py)."""
    from bench.load.load_stalls import shared_pauses

    fields = Outcome.__dataclass_fields__
    out = []
    for w, raw in sorted(zip(rec["windows"], rec.get("outcomes") or []), key=lambda x: x[0]["offered_rps"]):
        ps = shared_pauses([Outcome(**{k: v for k, v in o.items() if k in fields}) for o in raw])
        if ps:
            out.append(f"- at {w['offered_rps']:.2f} req/s, {len(ps)} wait(s) of >= 0.5 s for a token that several "
                       "streams sat through together, ending at the same engine step (a slow step, or a queue of "
                       "prefills before a first token): "
                       + ", ".join(f"ending {p['end_s']:.2f} s, {p['streams']} streams waited >= {p['pause_s']:.2f} s"
                                   for p in ps))
    return ([""] + out) if out else []


def _long_gaps(rec: dict) -> list[str]:
    """Per window, the inter-token gaps over 100 ms (a long prefill step the decoding streams waited through) and
    the gaps just before and after them (bench/load/long_gaps.py): where the ITL p99 lands when they are ~1% of gaps."""
    out = []
    for w, raw in sorted(zip(rec["windows"], rec.get("outcomes") or []), key=lambda x: x[0]["offered_rps"]):
        g = window_gaps(raw, 100.0)
        if g["long"]:
            ms = " / ".join("n/a" if g[k] is None else f"{g[k]:.1f}" for k in ("before_ms_p50", "long_ms_p50",
                                                                                  "after_ms_p50"))
            out.append(f"- at {w['offered_rps']:.2f} req/s, {g['long']} inter-token gaps over 100 ms "
                       f"({g['long_share_pct']:.2f}% of {g['gaps']}); the gap before / the long one / the gap after, "
                       f"p50: {ms} ms")
    return ([""] + out) if out else []


def _launches(rec: dict) -> list[str]:
    """Per window, the engines' eager steps of 2,048+ tokens and their mean host launch time (the tokens of the
    step before each wait that long with asynchronous scheduling, unless handed out first: early hand-outs)."""
    out = []
    for w in sorted(rec["windows"], key=lambda w: w["offered_rps"]):
        e = (w.get("stalls") or {}).get("engine") or {}
        n, s = e.get("long_launches"), e.get("long_launch_s")
        if n and s is not None:
            early = f"; {e['early_commits']:.0f} steps handed out before them" if e.get("early_commits") else ""
            out.append(f"- at {w['offered_rps']:.2f} req/s, {n:.0f} eager steps of 2,048+ tokens, host launch mean "
                       f"{1e3 * s / n:.1f} ms{early}")
    return ([""] + out) if out else []


def _timeline(rec: dict) -> list[str]:
    """Per window, where the engines' step time went (engine/step_timeline.py): steps, GPU busy and idle seconds
    (idle gaps of 1 ms or more: launches later than the step before them ended), the engine thread's host time per
    step apart from its waits, and a decode-graph step's mean GPU time and rows."""
    out = []
    for w in sorted(rec["windows"], key=lambda w: w["offered_rps"]):
        e = (w.get("stalls") or {}).get("engine") or {}
        n = e.get("timeline_steps")
        if not n:
            continue
        dg = e.get("decode_graph_timed_steps") or 0
        dec = (f"; decode-graph steps {dg:.0f}, GPU {1e3 * e['decode_graph_gpu_s'] / dg:.2f} ms at "
               f"{e['decode_graph_rows'] / dg:.1f} rows each" if dg else "")
        out.append(f"- at {w['offered_rps']:.2f} req/s, {n:.0f} timed steps: GPU busy {e['gpu_busy_s']:.2f} s "
                   f"({1e3 * e['gpu_busy_s'] / n:.2f} ms a step), idle between steps {e['gpu_idle_s']:.2f} s "
                   f"({e['gpu_idle_gaps']:.0f} gaps of 1 ms+, {e['gpu_idle_gaps_s']:.2f} s); host "
                   f"{1e3 * e['host_step_s'] / n:.2f} ms a step apart from {1e3 * e['sync_wait_s'] / n:.2f} ms waiting "
                   f"for the GPU{dec}")
    return ([""] + out) if out else []


def _kill(w: dict) -> str:
    k = w["kill"]
    if not k.get("fired"):
        return "the shard kill did not fire in this window"
    rec = f"restarted after {k['recovery_s']:.2f} s" if k.get("restarted") else "NOT restarted"
    gap = f"; longest token gap of those that completed {k['max_gap_s']:.2f} s" if k.get("max_gap_s") else ""
    return (f"at {w['offered_rps']:.2f} req/s: shard {k['shard']} killed {k['at_s']:.2f} s into the window, {rec}; "
            f"{k['in_flight']} requests in flight at the kill, {k['failed']} of them failed"
            + (f", {k['resumed']} stream(s) resumed" if k.get("resumed") is not None else "") + f"{gap}; "
            f"{k['failed_after']} of {k['sent_after']} sent after the kill failed"
            + (f"; the {k['sent_during_restart']} sent during the restart got their first token after at most "
               f"{k['ttft_max_during_restart_s']:.2f} s" if k.get("ttft_max_during_restart_s") is not None else "")
            + (f" ({'; '.join(k['errors'])})" if k.get("errors") else ""))


def render(records: list[dict]) -> str:
    """Markdown: per system one row per rate; every figure from the raw records."""
    if not records:
        return "no load records\n"
    records = [upgrade(r) for r in records]
    cfg = records[0]["config"]
    lens = _config(cfg).lengths()
    lines = [f"# Sustained load: document-QA Poisson stream, {cfg['doc_tokens']}-token documents x "
             f"{cfg['num_docs']}, {cfg['question_tokens']}-token questions, {lens.spec()} output tokens; "
             f"{cfg['duration_s']:.0f} s per rate; SLO TTFT <= {cfg['slo_ttft_s']} s and TPOT <= "
             f"{cfg['slo_tpot_s'] * 1000:.0f} ms; interactive goodput under MLPerf's bounds TTFT <= "
             f"{INTERACTIVE_TTFT_S} s and TPOT <= {INTERACTIVE_TPOT_S * 1000:.0f} ms", "",
             "`served`: completions over the window shifted by their median latency (a system that keeps up serves "
             "its arrivals in the window's length); `achieved`: completions over the whole span, to the last one. "
             f"A window is saturated when served < {cfg.get('sat_fraction', 0.95):.0%} of its arrivals.", ""]
    for rec in records:
        lines += [f"## {rec['system']}", "", saturation_line(rec), ""]
        lines += [f"- {x}" for x in _workload(rec)] + ([""] if _workload(rec) else [])
        lines += ["| offered req/s | arrivals req/s | served req/s | achieved req/s | saturated | output tok/s | "
                  "goodput req/s | SLO met % | interactive goodput req/s (met %) | rejected | failed | "
                  "TTFT p50 / p90 / p99 (s) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
                  "e2e p50 / p99 (s) | prefix hit % (evictions) | "
                  "JIT compiles / engine GC > 10 ms / client GC > 10 ms |",
                  "|---" * 17 + "|"]
        for w in sorted(rec["windows"], key=lambda w: w["offered_rps"]):
            t, p, i, e = w["ttft_s"], w["tpot_s"], w["itl_s"], w["e2e_s"]
            lines.append(f"| {w['offered_rps']:.2f} | {w['arrival_rps']:.3f} | {w['served_rps']:.3f} | "
                         f"{w['achieved_rps']:.3f} | "
                         f"{'yes' if w['saturated'] else 'no'} | {w['output_tok_s']:.1f} | {w['goodput_rps']:.3f} | "
                         f"{w['slo_met_pct']:.1f} | {w['interactive_rps']:.3f} ({w['interactive_met_pct']:.1f}) | "
                         f"{w['rejected']} | {w['failed']} | {_trio(t)} | {_ms(p, 'p50')} / {_ms(p, 'p99')} | "
                         f"{_ms(i, 'p50')} / {_ms(i, 'p99')} | {_pair(e)} | {_cache(w)} | {_stalls(w)} |")
        lines += _pauses(rec) + _long_gaps(rec) + _launches(rec) + _timeline(rec)
        kills = [_kill(w) for w in rec["windows"] if "kill" in w]
        lines += ([""] + [f"- shard kill {x}" for x in kills]) if kills else []
        lines.append("")
    if len(records) > 1:
        subject = records[0]
        lines += ["| capacity ratio | value |", "|---|---|"]
        for rec in records[1:]:
            a, b = subject["saturation_rps"], rec["saturation_rps"]
            if a and b:
                val = f"{a / b:.4f}"
            else:
                unsat = [r["system"] for r in (subject, rec) if not r["saturation_rps"]]
                val = f"n/a: {' and '.join(unsat)} did not saturate"
            lines.append(f"| {subject['system']} / {rec['system']} | {val} |")
        lines.append("")
    return "\n".join(lines)


def _trio(p: dict) -> str:
    return " / ".join(f"{p[k]:.3f}" for k in ("p50", "p90", "p99")) if p else "-"


def _pair(p: dict) -> str:
    return f"{p['p50']:.3f} / {p['p99']:.3f}" if p else "-"


def _ms(p: dict, k: str) -> str:
    return f"{1000 * p[k]:.1f}" if p else "-"


def write_load_report(out_dir: str, records: list[dict]) -> str:
    from bench.burst.report_plots import plot_load

    md = render(records)
    with open(os.path.join(out_dir, "load-report.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, "load-report.json"), "w") as f:
        json.dump([{k: v for k, v in upgrade(r).items() if k != "outcomes"} for r in records], f, indent=1)
    plot_load(records, os.path.join(out_dir, "load-report.png"))
    return md


def load_records(out_dir: str) -> list[dict]:
    """Every load record under out_dir/raw (load-*.json, or .json.gz: long answers' chunk times make MBs),
    upgraded to this code's figures."""
    raw = os.path.join(out_dir, "raw")
    recs = []
    for name in sorted(os.listdir(raw)) if os.path.isdir(raw) else []:
        if name.startswith("load-") and name.endswith((".json", ".json.gz")):
            rec = read_json(os.path.join(raw, name))
            if rec.get("format") in LOAD_FORMATS:
                recs.append(upgrade(rec))
    return recs


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.load.load_report DIR`: the load report again from every raw record under DIR/raw (systems run in
    separate calls into the same --out come together here; the first named with --subject leads the ratios)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.load.load_report", description=main.__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--subject", default="flame", help="the system the capacity ratios are of")
    a = p.parse_args(argv)
    recs = load_records(a.out)
    if not recs:
        raise SystemExit(f"no load records under {a.out}/raw")
    recs.sort(key=lambda r: r["system"] != a.subject)
    print(write_load_report(a.out, recs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
