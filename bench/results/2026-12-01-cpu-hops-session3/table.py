"""The README's tables from the bench.hops records here: one row per run (in the order they ran), then medians per
variant. python bench/results/2026-12-01-cpu-hops-session3/table.py ab-get ab-tell ab-final"""
import json
import os
import re
import statistics
import sys

here = os.path.dirname(os.path.abspath(__file__))
SPLIT = ["Ray request hop", "actor: decode", "Ray return hop"]


def row(path: str) -> dict:
    r = json.load(open(path))
    p, g = r["paths"], r["goals"]
    split = {k: v["p50"] for k, v in r.get("client_split_ms", {}).items()}
    pick = [next((v for k, v in split.items() if k.startswith(s)), float("nan")) for s in SPLIT]
    return {"door": p["door"]["ttft_ms"]["p50"], "serve": p["serve-http"]["ttft_ms"]["p50"],
            "over": g["ttft_p50_overhead_ms"], "itl_door": p["door"]["itl_ms"]["p99"],
            "itl_serve": p["serve-http"]["itl_ms"]["p99"], "ratio": g["itl_p99_ratio"], "req": pick[0],
            "actor": pick[1], "ret": pick[2]}


def order(name: str) -> tuple:
    m = re.match(r"hops-(.+)-(\d+)\.json", name)
    return int(m.group(2)), m.group(1)


COLS = ("door", "serve", "over", "itl_door", "itl_serve", "ratio", "req", "actor", "ret")
print("| run | door TTFT p50 | serve-http TTFT p50 | overhead | ITL p99 door | ITL p99 serve-http | ratio | "
      "request hop | actor to first chunk | return hop |")
print("|---|" + "---|" * len(COLS))
by: dict = {}
for folder in sys.argv[1:]:
    names = sorted((f for f in os.listdir(os.path.join(here, folder)) if f.startswith("hops-") and f.endswith(".json")),
                   key=order)
    for f in names:
        x = row(os.path.join(here, folder, f))
        by.setdefault((folder, order(f)[1]), []).append(x)
        print(f"| {folder}/{f} | " + " | ".join(f"{x[c]:.2f}" for c in COLS) + " |")
print()
print("| batch, variant (runs) | " + " | ".join(COLS) + " |")
print("|---|" + "---|" * len(COLS))
for (folder, v), xs in by.items():
    print(f"| {folder}, {v} ({len(xs)}) | " + " | ".join(f"{statistics.median(x[c] for x in xs):.2f}" for c in COLS)
          + " |")
