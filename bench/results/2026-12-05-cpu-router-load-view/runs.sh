#!/usr/bin/env bash
# Session 19, issue 42: router replicas on a shared load view (router/load_view.py). A: session 18's workload (1,000
# shards, 10k req/s, 1 s, documents 3x the cluster's KV, Zipf 0.8), replicas 1/2/4, load_view own (as before) /
# engines (each shard's load read by every replica every 20 ms, as the event feed polls; load_row_cost 1000 past
# load_row_free 4, the defaults) / peers (every 50 ms). *-rowcost0 and *-rowcost1000-free0: the same runs with
# --load-row-cost 0, and with --load-row-cost 1000 --load-row-free 0.
set -euo pipefail
out=bench/results/2026-12-05-cpu-router-load-view
common="--num-shards 1000 --num-blocks 512 --rate 10000 --duration-s 1 --num-docs 96000 --doc-zipf 0.8"
view="--load-view engines --load-bucket 512 --load-poll-s 0.02"
python3 -m bench.service.router_sim $common --policies events,oracle --out $out/a-r1-own.jsonl
python3 -m bench.service.router_sim $common --policies events $view --out $out/a-r1-engines.jsonl
for n in 2 4; do
  python3 -m bench.service.router_sim $common --policies events $view --num-replicas $n --out $out/a-r$n-engines.jsonl
  python3 -m bench.service.router_sim $common --policies events --num-replicas $n --out $out/a-r$n-own.jsonl
  python3 -m bench.service.router_sim $common --policies events --load-view peers --load-bucket 512 --num-replicas $n \
    --out $out/a-r$n-peers.jsonl
done
python3 -m bench.service.router_sim $common --policies events $view --num-replicas 2 --router-rtt-s 0.002 \
  --kill-replica-at-s 0.5 --revive-after-s 0.3 --out $out/a-r2-engines-kill.jsonl
