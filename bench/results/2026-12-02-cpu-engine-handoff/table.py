"""Per-run and median tables of the interleaved bench.hops runs: python table.py ab [more dirs]."""
import glob
import gzip
import json
import re
import statistics
import sys
from collections import defaultdict


def load(path):
    with (gzip.open if path.endswith(".gz") else open)(path) as f:
        return json.load(f)


pooled: dict = defaultdict(list)
cols = ("door TTFT", "serve-http TTFT", "overhead", "ITL p99 door", "ITL p99 serve-http", "ratio")
for d in sys.argv[1:]:
    runs = defaultdict(list)
    for path in sorted(glob.glob(f"{d}/hops-*.json*")):
        name, rnd = re.match(r".*/hops-(.+)-(\d+)\.json", path).groups()
        r = load(path)
        p, g = r["paths"], r["goals"]
        runs[name].append((int(rnd), (p["door"]["ttft_ms"]["p50"], p["serve-http"]["ttft_ms"]["p50"],
                                      g["ttft_p50_overhead_ms"], p["door"]["itl_ms"]["p99"],
                                      p["serve-http"]["itl_ms"]["p99"], g["itl_p99_ratio"])))
    print(f"\n{d}: per run (ms; TTFT p50)\n| variant, round | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for name, rs in runs.items():
        for rnd, v in sorted(rs):
            print(f"| {name} {rnd} | " + " | ".join(f"{x:.2f}" for x in v) + " |")
    for name, rs in runs.items():
        pooled[name] += rs
    print(f"\n{d}: medians over rounds\n| variant (runs) | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for name, rs in runs.items():
        med = [statistics.median(v[i] for _, v in rs) for i in range(len(cols))]
        print(f"| {name} ({len(rs)}) | " + " | ".join(f"{x:.2f}" for x in med) + " |")
if len(sys.argv) > 2:
    print(f"\n{' + '.join(sys.argv[1:])}: medians of all runs\n| variant (runs) | " + " | ".join(cols) + " |\n|---|"
          + "---|" * len(cols))
    for name, rs in pooled.items():
        med = [statistics.median(v[i] for _, v in rs) for i in range(len(cols))]
        print(f"| {name} ({len(rs)}) | " + " | ".join(f"{x:.2f}" for x in med) + " |")
