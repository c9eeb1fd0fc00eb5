#!/bin/sh
# The CPU runs of issue 18 item 6's workloads (tiny model, two CPU shards, short windows): each exercises its code
# path and writes its report; the figures are CPU smoke figures, not the GPU comparison (see README.md here).
set -e
D=${D:-bench/results/2026-12-01-cpu-load-workloads}
COMMON="--model tiny --load-format auto --doc-tokens 256 --question-tokens 16 --max-model-len 2048 --max-num-seqs 16 --max-num-batched-tokens 512 --warmup-requests 4 --drain-s 120"
run() { name=$1; shift; RAY_ADDRESS= python3 -m bench.cli bench --mode load $COMMON "$@" --out $D/$name > $D/$name.log 2>&1; }
run answer-lengths --systems flame,engine --docs 8 --rates 1,2 --duration-s 8 --output-len lognormal:16-1024 --engine-json '{"cpu_kvcache_gib": 0.25}'
run hot-prefixes --systems flame,flame-rr,engine --docs 32 --rates 4,8 --duration-s 8 --output-tokens 16 --doc-zipf 1.2 --engine-json '{"cpu_kvcache_gib": 0.25}'
run eviction --systems flame,engine --docs 64 --rates 4 --duration-s 8 --output-tokens 16 --engine-json '{"num_kvcache_blocks": 24}'
run shard-kill --systems flame --docs 8 --rates 8 --duration-s 12 --output-tokens 256 --kill-shard-at 2 --engine-json '{"cpu_kvcache_gib": 0.25}'
run startup --systems flame,engine --docs 4 --rates 1 --duration-s 2 --output-tokens 4 --engine-json '{"cpu_kvcache_gib": 0.25}'
