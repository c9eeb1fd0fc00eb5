#!/bin/bash
# usage: ab.sh OUTDIR ROUNDS 'name=snapshot_dir=engine_json' ... ; runs bench.hops from each snapshot with its
# --engine-json in turn, ROUNDS times (rounds interleave the variants: the shared machine's drift hits all alike)
out=$1; rounds=$2; shift 2
mkdir -p $out
for i in $(seq 1 $rounds); do
  for spec in "$@"; do
    name=${spec%%=*}; rest=${spec#*=}; dir=${rest%%=*}; ej=${rest#*=}
    (cd $dir && PYTHONPATH=$dir RAY_ADDRESS= timeout 900 python -m bench.hops --requests 60 --engine-json "$ej" \
      --out $out/hops-$name-$i.json --logs /tmp/ho/logs-$name > $out/hops-$name-$i.log 2>&1)
    python3 -c "
import json;r=json.load(open('$out/hops-$name-$i.json'));g=r['goals'];p=r['paths']
print('$name-$i', 'load', open('/proc/loadavg').read().split()[0], 'overhead %.2f itl99 %.2f'%(g['ttft_p50_overhead_ms'],g['itl_p99_ratio']), ' '.join('%s %.2f/%.2f'%(k,v['ttft_ms']['p50'],v['itl_ms']['p99']) for k,v in p.items() if k in ('serve-http','door')), flush=True)
" | tee -a $out/summary.txt
  done
done
