"""The paired report's picture, one row per trace: req/s per system with every pair's point and the
median; each ratio of the subject to another system with its paired range; completion-latency CDFs;
the service path's per-batch times (systems that report them). And the load report's chart (plot_load)."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def render_png(rep: dict, path: str) -> bool:
    """Write the picture; False (and a warning) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no PNG written (pip install matplotlib)")
        return False
    names = list(rep["traces"])
    fig, axes = plt.subplots(len(names), 4, figsize=(20, 4.2 * len(names)), squeeze=False)
    for row, name in zip(axes, names, strict=True):
        t = rep["traces"][name]
        _throughput(row[0], name, t)
        _ratios(row[1], name, t)
        _latency_cdf(row[2], name, t)
        _service_path(row[3], name, t)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _throughput(ax, name: str, t: dict) -> None:
    pairs = sorted({x["pair"] for lab in t["systems"] for x in t["stats"][lab]["per_run"] if x["ok"]})
    for p in pairs:  # one gray line per pair across the systems
        pts = [(i, x["req_s"]) for i, lab in enumerate(t["systems"]) for x in t["stats"][lab]["per_run"]
               if x["ok"] and x["pair"] == p]
        ax.plot([a for a, _ in pts], [b for _, b in pts], color="0.8", linewidth=0.8, zorder=0)
    for i, lab in enumerate(t["systems"]):
        s = t["stats"][lab]
        ys = [x["req_s"] for x in s["per_run"] if x["ok"]]
        ax.scatter([i] * len(ys), ys, alpha=0.7)
        if s["req_s"]:
            ax.hlines(s["req_s"]["median"], i - 0.3, i + 0.3, colors="black")
    ax.set_xticks(range(len(t["systems"])), t["systems"])
    ax.set_title(f"{name}: req/s, every pair (bar: median)")
    ax.set_ylabel("requests / s")
    ax.set_ylim(bottom=0)


def _ratios(ax, name: str, t: dict) -> None:
    ratios = [r for r in t["ratios"] if r["ratio_of_medians"] is not None]
    for i, r in enumerate(ratios):
        vals = list(r["paired"].values())
        ax.scatter([i] * len(vals), vals, alpha=0.7, label="pairs" if i == 0 else None)
        ax.hlines(r["ratio_of_medians"], i - 0.3, i + 0.3, colors="black", label="of medians" if i == 0 else None)
        if vals:
            ax.vlines(i, min(vals), max(vals), colors="0.5", linewidth=2, zorder=0)
    ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(ratios)), [f"{r['subject']}/{r['reference']}" for r in ratios])
    ax.set_title(f"{name}: ratio of req/s (line: paired range)")
    if ratios:
        ax.legend(fontsize=7)


def _latency_cdf(ax, name: str, t: dict) -> None:
    for lab in t["systems"]:
        pts = t["stats"][lab].get("latency_points") or []
        if pts:
            ax.plot(pts, [i / (len(pts) - 1) for i in range(len(pts))], label=lab)
    ax.set_title(f"{name}: completion time from release (CDF)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _service_path(ax, name: str, t: dict) -> None:
    rows = {lab: sp for lab in t["systems"] if (sp := t["stats"][lab].get("service_path"))}
    if not rows:
        ax.set_axis_off()
        ax.set_title(f"{name}: no service-path counters")
        return
    keys = list(next(iter(rows.values()))["per_batch_ms"])
    width = 0.8 / len(rows)
    for j, (lab, sp) in enumerate(rows.items()):
        ax.bar([k + j * width for k in range(len(keys))], [sp["per_batch_ms"][k] or 0.0 for k in keys], width,
               label=lab)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], keys, rotation=20, fontsize=7)
    ax.set_title(f"{name}: service path per batch (ms)")
    ax.legend(fontsize=7)


def plot_load(records: list[dict], path: str) -> bool:
    """The load report's chart: latency (TTFT and e2e, p50 and p99) and throughput against offered load, every
    system on one chart, one colour each (windows in rate order); False without matplotlib."""
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
        wins = sorted(rec["windows"], key=lambda w: w["offered_rps"])  # the auto search runs them out of order
        ws = [w for w in wins if w["ttft_s"]]
        x = [w["offered_rps"] for w in ws]
        axes[0].plot(x, [w["ttft_s"]["p50"] for w in ws], "o-", color=c, label=f"{rec['system']} p50")
        axes[0].plot(x, [w["ttft_s"]["p99"] for w in ws], "o--", color=c, label=f"{rec['system']} p99")
        top = max([top, *(w["ttft_s"]["p99"] for w in ws)])
        axes[1].plot(x, [w["e2e_s"]["p50"] for w in ws], "o-", color=c, label=f"{rec['system']} p50")
        axes[1].plot(x, [w["e2e_s"]["p99"] for w in ws], "o--", color=c, label=f"{rec['system']} p99")
        offered = [w["offered_rps"] for w in wins]
        axes[2].plot(offered, [w["goodput_rps"] for w in wins], "o-", color=c,
                     label=f"{rec['system']} goodput")
        axes[2].plot(offered, [w["achieved_rps"] for w in wins], "x:", color=c,
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
