#!/bin/bash
# usage: s22-run.sh LABEL extra-args...
cd /work/wt/s22-flood
label=$1; shift
out=bench/results/2026-12-06-cpu-flood-tail/$label.json
echo "$label start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) args $*" >> bench/results/2026-12-06-cpu-flood-tail/runs.txt
RAY_ADDRESS= PYTHONPATH=$PWD timeout 500 python3 -m bench.service.stream_flood --connections ${CONNS:-20000} --hold-s 20 --door --valid 100 "$@" > $out 2>/tmp/s22-$label.err
echo "$label end $(date -u +%T) rc $? load $(cut -d' ' -f1-3 /proc/loadavg)" >> bench/results/2026-12-06-cpu-flood-tail/runs.txt
