#!/bin/bash
# usage: ab.sh OUTDIR ROUNDS name1=dir1 name2=dir2 ... ; runs bench.hops from each snapshot dir in turn, ROUNDS times
out=$1; rounds=$2; shift 2
mkdir -p $out
for i in $(seq 1 $rounds); do
  for spec in "$@"; do
    name=${spec%%=*}; dir=${spec#*=}
    (cd $dir && PYTHONPATH=$dir RAY_ADDRESS= timeout 900 python -m bench.hops --requests 60 --out $out/hops-$name-$i.json --logs /tmp/sh/logs-ab-$name > $out/hops-$name-$i.log 2>&1)
    python3 -c "
import json;r=json.load(open('$out/hops-$name-$i.json'));g=r['goals'];p=r['paths'];s=r.get('client_split_ms',{})
print('$name-$i', 'load', open('/proc/loadavg').read().split()[0], 'overhead %.2f itl99 %.2f'%(g['ttft_p50_overhead_ms'],g['itl_p99_ratio']), ' '.join('%s %.2f/%.2f'%(k,v['ttft_ms']['p50'],v['itl_ms']['p99']) for k,v in p.items()), 'split', ' '.join('%.2f'%v['p50'] for v in s.values()), flush=True)
" | tee -a $out/summary.txt
  done
done
