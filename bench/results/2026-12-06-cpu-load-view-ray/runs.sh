#!/bin/sh
# Session 21, issue 42: real engines publish their load with their cache events (kv_events with_load).
python3 -m bench.service.load_view_ray --rounds 3 --out bench/results/2026-12-06-cpu-load-view-ray/ttft.json
python3 -m bench.service.load_view_ray --step-cost --out bench/results/2026-12-06-cpu-load-view-ray/step_cost.json
python3 -m bench.service.load_view_ray --feed-cost --rounds 6 --out bench/results/2026-12-06-cpu-load-view-ray/feed_cost.json
