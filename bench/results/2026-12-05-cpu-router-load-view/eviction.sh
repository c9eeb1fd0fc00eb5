#!/usr/bin/env bash
# Session 19, issue 42: B, the eviction workload saturated (40k req/s offered for 1.5 s, 1,000 shards), documents 2x
# and 4x the cluster's KV: approximate routing (load_guarded) vs event routing, one router on own counts, and the
# engines load view with 1 and 4 replicas (defaults: load_row_cost 1000 past load_row_free 4). *-rowcost0 and
# *-rowcost1000-free0: the same with --load-row-cost 0, and --load-row-cost 1000 --load-row-free 0.
set -euo pipefail
out=bench/results/2026-12-05-cpu-router-load-view
common="--num-shards 1000 --num-blocks 512 --rate 40000 --duration-s 1.5 --doc-zipf 0.8"
view="--load-view engines --load-bucket 512 --load-poll-s 0.02"
for docs in 64000 128000; do
  python3 -m bench.service.router_sim $common --num-docs $docs --policies load_guarded,events --out $out/b-$docs.jsonl
  python3 -m bench.service.router_sim $common --num-docs $docs --policies events $view --out $out/b-$docs-engines.jsonl
  python3 -m bench.service.router_sim $common --num-docs $docs --policies events $view --num-replicas 4 \
    --out $out/b-$docs-engines-r4.jsonl
done
