#!/bin/bash
cd "$(git rev-parse --show-toplevel)"
OUT=bench/results/2026-12-04-cpu-router-sim
export PYTHONPATH=$PWD
python3 -m bench.router_sim --num-shards 1000 --num-blocks 512 --rate 10000 --duration-s 3 --num-docs 96000 --doc-zipf 0.8 --policies load_guarded,events,oracle --out $OUT/a-1000x10k-3xkv.jsonl
python3 -m bench.router_sim --num-shards 1000 --num-blocks 512 --rate 10000 --duration-s 3 --num-docs 96000 --doc-zipf 0.8 --policies events --num-replicas 4 --route-ttl-s 1.0 --router-rtt-s 0.002 --kill-replica-at-s 1.5 --revive-after-s 1.0 --out $OUT/c-1000x10k-4replicas-kill.jsonl
python3 -m bench.router_sim --num-shards 1000 --num-blocks 512 --rate 40000 --duration-s 1.5 --num-docs 64000 --doc-zipf 0.8 --policies load_guarded,events,oracle --out $OUT/b-1000x40k-2xkv.jsonl
python3 -m bench.router_sim --num-shards 1000 --num-blocks 512 --rate 40000 --duration-s 1.5 --num-docs 128000 --doc-zipf 0.8 --policies load_guarded,events,oracle --out $OUT/b-1000x40k-4xkv.jsonl
