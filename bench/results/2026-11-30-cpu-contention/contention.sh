set -u
cd /work/main
ARGS="--traces no-reuse --pairs 1 --model /tmp/tiny32k --load-format auto --docs 16 --max-model-len 32768 --max-num-batched-tokens 8192 --max-num-seqs 64 --policy cumulative"
ray stop --force >/dev/null 2>&1
export RAY_ADDRESS=
python3 -m bench.pairs --systems engine,flame $ARGS --engine-json '{"cpu_kvcache_gib": 0.25}' --out /tmp/cont_a > /tmp/cont_a.log 2>&1
# the same engine runs again with an idle Ray service (router + two CPU shards) beside it
python3 - > /tmp/cont_svc.log 2>&1 <<'PY' &
import time
from flame_llm.service import start_service
from flame_llm.service_config import ServiceConfig
svc = start_service(ServiceConfig(model="tiny", num_shards=2, namespace="idle-neighbour"))
print("up", flush=True)
time.sleep(900)
PY
SVC=$!
sleep 25
python3 -m bench.pairs --systems engine $ARGS --engine-json '{"cpu_kvcache_gib": 0.25}' --out /tmp/cont_b > /tmp/cont_b.log 2>&1
kill $SVC; ray stop --force >/dev/null 2>&1
echo done
