#!/bin/bash
# usage: ab.sh OUTDIR ROUNDS name1='CLIENT_JSON' name2='CLIENT_JSON' ... [-- EXTRA bench.hops ARGS]
# Runs `bench.hops --requests 60` once per variant in turn (the door's and the Python client's ClientConfig fields
# from --client-json), ROUNDS times, from this tree; one summary line per run (with the 1-min load average).
out=$1; rounds=$2; shift 2
specs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do specs+=("$1"); shift; done; [ "$1" == "--" ] && shift
root=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$out"
for i in $(seq 1 "$rounds"); do
  for spec in "${specs[@]}"; do
    name=${spec%%=*}; cj=${spec#*=}
    load=$(cut -d' ' -f1 /proc/loadavg)
    (cd "$root" && PYTHONPATH=$root RAY_ADDRESS= timeout 900 python3 -m bench.hops --requests 60 --client-json "$cj" \
      "$@" --out "$out/hops-$name-$i.json" --logs "/tmp/ss/logs-ab-$name" > "$out/hops-$name-$i.log" 2>&1)
    python3 -c "
import json;r=json.load(open('$out/hops-$name-$i.json'));g=r['goals'];p=r['paths'];s=r.get('client_split_ms',{})
print('$name-$i', 'load', '$load', 'overhead %.2f itl99 %.2f'%(g['ttft_p50_overhead_ms'],g['itl_p99_ratio']), ' '.join('%s %.2f/%.2f'%(k,v['ttft_ms']['p50'],v['itl_ms']['p99']) for k,v in p.items()), 'split', ' '.join('%.2f'%v['p50'] for v in s.values()), flush=True)
" | tee -a "$out/summary.txt"
  done
done
