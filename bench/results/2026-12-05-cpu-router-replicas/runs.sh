#!/usr/bin/env bash
# Session 18, issue 42 router scale-out: 1,000 shards, 10k req/s, A's workload (bench/RESULTS.md), 1 s, 1/2/4 replicas
set -euo pipefail
out=bench/results/2026-12-05-cpu-router-replicas
common="--num-shards 1000 --num-blocks 512 --rate 10000 --duration-s 1 --num-docs 96000 --doc-zipf 0.8"
python3 -m bench.router_sim $common --policies events,oracle --out $out/r1.jsonl
for n in 2 4; do
  python3 -m bench.router_sim $common --policies events --num-replicas $n --out $out/r$n.jsonl
done
python3 -m bench.router_sim $common --policies events --num-replicas 2 --router-rtt-s 0.002 \
  --kill-replica-at-s 0.5 --revive-after-s 0.3 --out $out/r2-kill.jsonl
