"""The README's tables from the bench.hops records here (plain or gzipped JSON): one row per run in the order they
ran, medians per variant, and the paired runs' per-variant figures.
python3 bench/results/2026-12-02-cpu-socket-stream/table.py"""
import gzip
import json
import os
import re
import statistics

here = os.path.dirname(os.path.abspath(__file__))
SPLIT = ["Ray request hop", "actor: decode", "Ray return hop"]  # the socket's hops for the socket transport
COLS = ("door", "serve", "over", "itl_door", "itl_serve", "ratio", "req", "actor", "ret")


def load(path: str) -> dict:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def row(r: dict, tag: str = "") -> dict:
    p, e = r["paths"], r["paths"]["serve-http"]
    d = p[f"door{tag}"]
    split = {k: v["p50"] for k, v in r.get(f"client_split_ms{tag}", {}).items()}
    pick = [next((v for k, v in split.items() if k.startswith(s)), float("nan")) for s in SPLIT]
    return {"door": d["ttft_ms"]["p50"], "serve": e["ttft_ms"]["p50"],
            "over": d["ttft_ms"]["p50"] - e["ttft_ms"]["p50"],
            "itl_door": d["itl_ms"]["p99"], "itl_serve": e["itl_ms"]["p99"],
            "ratio": d["itl_ms"]["p99"] / e["itl_ms"]["p99"], "req": pick[0], "actor": pick[1], "ret": pick[2]}


def runs(folder: str):
    names = [f for f in os.listdir(os.path.join(here, folder)) if re.match(r"hops-.+-\d+\.json(\.gz)?$", f)]
    key = lambda f: (int(re.search(r"-(\d+)\.json", f).group(1)), f)  # noqa: E731
    return [(f, re.match(r"hops-(.+)-\d+\.json", f).group(1), load(os.path.join(here, folder, f)))
            for f in sorted(names, key=key)]


AB = ("ab", "ab2")  # alternating runs: 3 rounds at f89b2a8, 2 at 1852bec (the same stream path)
HEAD = ("| {} | door TTFT p50 | serve-http TTFT p50 | overhead (goal <= 3) | ITL p99 door | ITL p99 serve-http | "
        "ratio (goal <= 1.2) | request hop | actor to first chunk | return hop |")


def main() -> None:
    by: dict = {}
    print(HEAD.format("run (load at start)"))
    print("|---|" + "---|" * len(COLS))
    for folder in AB:
        loads = {}
        for line in open(os.path.join(here, folder, "summary.txt")):
            name, _, load_avg = line.split()[:3]
            loads[name] = load_avg
        for f, name, r in runs(folder):
            x = row(r)
            by.setdefault(name, []).append(x)
            n = re.search(r"-(\d+)\.json", f).group(1)
            print(f"| {folder}/{f} ({loads.get(f'{name}-{n}', '?')}) | " + " | ".join(f"{x[c]:.2f}" for c in COLS)
                  + " |")
    print()
    print(HEAD.format("variant (runs): medians"))
    print("|---|" + "---|" * len(COLS))
    for name, xs in by.items():
        print(f"| {name} ({len(xs)}) | " + " | ".join(f"{statistics.median(x[c] for x in xs):.2f}" for c in COLS)
              + " |")
    print()
    print("| paired run: base, variant | base overhead | variant overhead | base ITL ratio | variant ITL ratio | "
          "paired door TTFT diff (variant - base) | paired client TTFT diff |")
    print("|---|---|---|---|---|---|---|")
    for folder in sorted(d for d in os.listdir(here) if d.startswith("paired-")):
        for f, name, r in runs(folder):
            for v, ab in r.get("ab", {}).items():
                b = row(r)
                print(f"| {folder}/{f}: {name}, {v} | {b['over']:.2f} | {ab['ttft_p50_overhead_ms']:.2f} | "
                      f"{b['ratio']:.2f} | {ab['itl_p99_ratio']:.2f} | {ab['paired_ttft_diff_ms']['door']:+.2f} | "
                      f"{ab['paired_ttft_diff_ms']['client']:+.2f} |")


if __name__ == "__main__":
    main()
