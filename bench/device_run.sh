#!/usr/bin/env bash
# One device call = one stage (the device tool's command line is short). From the repo root there:
#   bash bench/device_run.sh STAGE
# Unpacks .device/site.tar.xz (Ray, zstandard; built by ../shared/tools/device-bundle) and writes
# logs and JSON under $OUT.
set -uo pipefail
tar -xJf .device/site.tar.xz -C /tmp || exit 1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
stage=${1:?stage}
shift
case $stage in
  smoke)
    python3 -m pytest tests/test_gpu_engine.py tests/test_fused_kernels.py tests/test_triton_attention.py -q -x \
      2>&1 | tail -30 | tee "$OUT/smoke.log"
    timeout 420 python3 -m bench.gpu_engine --out "$OUT/engine.json" "$@" 2>&1 | grep -v INFO | tail -60 ;;
  smoke-engine)
    python3 -m pytest tests/test_gpu_engine.py tests/test_fused_kernels.py -q -x 2>&1 | tail -15 | tee "$OUT/smoke.log"
    timeout 480 python3 -m bench.gpu_engine --out "$OUT/engine.json" "$@" 2>&1 | grep -v INFO | tail -40 ;;
  debug-kernels)
    python3 -m pytest tests/test_gpu_engine.py tests/test_triton_attention.py -q -m gpu 2>&1 | tail -25 | tee "$OUT/smoke.log"
    timeout 300 python3 bench/gpu_kernels.py --out "$OUT/kernels.json" 2>&1 | tail -45 ;;
  final)
    python3 -m pytest tests/test_gpu_engine.py -q 2>&1 | tail -6 | tee "$OUT/smoke.log"
    timeout 235 python3 -m bench.gpu_engine --out "$OUT/engine.json" --parts ceilings,prefill,decode,traces,graphs \
      --max-batched 8192 --chunked 1 > "$OUT/engine.log" 2>&1; tail -3 "$OUT/engine.log"
    timeout 130 python3 -m bench.spec_bench --out "$OUT/spec.json" --batches 1,4,16 --ks 2,3 --agreements 0.76 \
      --max-tokens 96 > "$OUT/spec.log" 2>&1; tail -25 "$OUT/spec.log"
    for s in prefix starvation; do
      timeout 70 python3 -m bench.scenarios --scenario $s --out "$OUT/scen_$s.json" > "$OUT/scen_$s.log" 2>&1
      tail -8 "$OUT/scen_$s.log"
    done ;;
  pairs)  # issue 6/7 on nvidia-h200-x2, e.g. `pairs --systems flame,engine --traces reuse --pairs 2`
    export RAY_ADDRESS=
    timeout 120 python3 -m pytest tests/test_gpu_service.py -q -x 2>&1 | tail -8  # pinning + service on the GPUs
    timeout 440 python3 -m bench.pairs "$@" --out /tmp/r 2>&1 | grep -v -e INFO -e WARNING | tail -40
    tar czf "$OUT/pairs.tgz" -C /tmp r ;;
  kernels)
    timeout 300 python3 bench/gpu_kernels.py --out "$OUT/kernels.json" 2>&1 | tail -60 ;;
  engine)
    timeout 540 python3 -m bench.gpu_engine --out "$OUT/engine.json" "$@" 2>&1 | grep -v INFO | tail -60 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
