"""Merging raw records of several calls and machines into one paired report (bench/burst/report.py uses these).

A pair is formed inside one call on one machine, never across: pair p of a trace is the runs of every system with
pair index p, and when those runs name different machines or calls (records merged by hand, or a --pair-start
reused) the pair is flagged and left out of the paired ratios. The per-system medians pool every machine's runs;
the report's machine table says which pairs ran where, on which commit, and whether through `ray job submit`.
Records from before provenance was recorded (bench/provenance.py) name their machine by host and placement and
their call as unknown.
"""
from __future__ import annotations

from collections import defaultdict


def machine_of(run: dict) -> dict:
    """The run's machine: recorded, or for an older record its host and shard placement (the GPUs it used)."""
    m = run.get("machine")
    if m:
        return m
    gpus = [d for d in run.get("placement") or [] if d.startswith("GPU-")]
    host = run.get("host", "?")
    return {"id": ",".join(sorted(gpus)) or f"host:{host}", "host": host, "host_id": "",
            "gpus": [{"uuid": u, "name": "?"} for u in gpus], "gpu_name": "?" if gpus else "cpu"}


def call_of(run: dict) -> dict:
    """The run's call (one bench.burst.pairs invocation); an older record's is unknown (id None)."""
    return run.get("call") or {"id": None, "via": "unknown", "commit": "", "source_digest": ""}


def dedupe(runs: list[dict]) -> list[dict]:
    """One record per (trace, system, pair). The same record found twice (one call's tarball extracted into two
    folders: same call, same start) is kept once; two different runs claiming one pair are refused."""
    seen: dict[tuple, dict] = {}
    out = []
    for r in runs:
        key = (r["trace"]["name"], r["label"], r["pair"])
        prev = seen.get(key)
        if prev is None:
            seen[key] = r
            out.append(r)
        elif (call_of(prev)["id"], prev.get("started_at")) != (call_of(r)["id"], r.get("started_at")):
            raise ValueError(f"two runs claim trace {key[0]!r} system {key[1]!r} pair {key[2]}: {prev.get('path')} "
                             f"(call {call_of(prev)['id']}) and {r.get('path')} (call {call_of(r)['id']}); a "
                             "continuation must use --pair-start past the pairs already there: move one away")
    return out


def pair_provenance(by_label: dict[str, list[dict]]) -> dict:
    """Per pair of one trace: where its runs ran; which pairs mix machines or calls (left out of paired ratios)."""
    by_pair: dict[int, list[dict]] = defaultdict(list)
    for runs in by_label.values():
        for r in runs:
            by_pair[r["pair"]].append(r)
    names: dict[str, str] = {}  # machine id -> M1, M2, ... in order of first pair
    machines: dict[str, dict] = {}
    rows, mixed = [], {}
    for p in sorted(by_pair):
        runs = sorted(by_pair[p], key=lambda r: r["position"])
        ms = [machine_of(r) for r in runs]
        calls = [call_of(r) for r in runs]
        for m in ms:
            if m["id"] not in names:
                names[m["id"]] = f"M{len(names) + 1}"
                machines[names[m["id"]]] = {**m, "pairs": []}
        for name in dict.fromkeys(names[m["id"]] for m in ms):
            machines[name]["pairs"].append(p)
        ids = {m["id"] for m in ms}
        call_ids = {c["id"] for c in calls}
        if len(ids) > 1:
            mixed[p] = f"its runs ran on different machines ({', '.join(sorted(names[i] for i in ids))})"
        elif len(call_ids) > 1:
            mixed[p] = f"its runs came from different calls ({', '.join(sorted(str(c) for c in call_ids))})"
        rows.append({"pair": p, "machine": ",".join(dict.fromkeys(names[m["id"]] for m in ms)),
                     "call": ",".join(dict.fromkeys(str(c["id"]) for c in calls)),
                     "via": ",".join(dict.fromkeys(c.get("via", "unknown") for c in calls)),
                     "commit": ",".join(dict.fromkeys(c.get("commit") or "?" for c in calls)),
                     "source_digest": ",".join(dict.fromkeys(c.get("source_digest") or "?" for c in calls)),
                     "order": [r["label"] for r in runs], "mixed": mixed.get(p)})
    return {"machines": machines, "pairs": rows, "mixed": mixed, "warnings": _warnings(machines, rows, mixed)}


def _warnings(machines: dict, rows: list[dict], mixed: dict) -> list[str]:
    out = [f"pair {p} is left out of the paired ratios: {why}; a pair is only formed inside one call on one "
           "machine" for p, why in sorted(mixed.items())]
    if len(machines) > 1:
        out.append(f"the runs come from {len(machines)} machines: each system's median [min-max] pools them "
                   "(two H200s differ by a few %), the paired ratios are within one machine each")
    code = {r["source_digest"] for r in rows if not r["mixed"]}
    if len(code) > 1:
        out.append(f"the pairs ran {len(code)} different source trees (digests {', '.join(sorted(code))}): the "
                   "medians pool different code")
    return out


def render_provenance(t: dict) -> list[str]:
    """The machine table and the pair table of one trace's report."""
    prov = t.get("provenance")
    if not prov:
        return []
    vias = sorted({r["via"] for r in prov["pairs"]})
    lines = ["", f"Where the pairs ran ({len(prov['machines'])} machine(s), launched via: {', '.join(vias)}; a "
             "pair's ratios are within one call on one machine):", "",
             "| machine | GPUs | host | pairs |", "|---|---|---|---|"]
    for name, m in prov["machines"].items():
        gpus = ", ".join(f"{g.get('name', '?')} `{g['uuid']}`" for g in m["gpus"]) or "none (CPU)"
        lines.append(f"| {name} | {gpus} | {m['host']} | {', '.join(map(str, m['pairs']))} |")
    lines += ["", "| pair | machine | call | launched via | commit | sources | order |", "|---" * 7 + "|"]
    for r in prov["pairs"]:
        flag = f" **left out: {r['mixed']}**" if r["mixed"] else ""
        lines.append(f"| {r['pair']} | {r['machine']} | {r['call']} | {r['via']} | {r['commit'] or '?'} | "
                     f"{r['source_digest']} | {' '.join(r['order'])}{flag} |")
    return lines
