#!/usr/bin/env bash
# One device call = one stage (the device tool's command line is short). From the repo root there:
#   bash bench/device_run.sh take K        (the first calls: move chunk .bundleK aside; see device_bundles.sh)
#   bash bench/device_run.sh STAGE [ARGS]  (unpacks the chunks once, then runs STAGE)
# Packages: flash-attn-4 (/tmp/fa4/site), vLLM (/tmp/vsite/site, for vllm replicas only), wheels such as
# zstandard (/tmp/wheels), and Ray when a call carries .device/site.tar.xz (/tmp/site; flame needs it, HTTP
# systems do not). Logs and JSON go to $OUT.
set -uo pipefail
stage=${1:?stage}
shift
if [[ $stage == take ]]; then
  mkdir -p /tmp/chunks && mv .bundle"$1"/* /tmp/chunks/ && ls -l /tmp/chunks
  nvidia-smi --query-gpu=index,uuid,name,memory.total,clocks.sm --format=csv,noheader
  exit 0
fi
unbundle() {  # reassemble the chunks into the archives of MANIFEST, check them, unpack in parallel
  [[ -f /tmp/unbundled ]] && return 0
  [[ -f /tmp/chunks/MANIFEST ]] || return 0
  cat $(ls /tmp/chunks/chunk_* | sort) > /tmp/all.bin || return 1
  local off=0 name size sha
  while read -r name size sha; do
    tail -c +$((off + 1)) /tmp/all.bin | head -c "$size" > "/tmp/$name"
    [[ $(sha256sum < "/tmp/$name" | cut -d' ' -f1) == "$sha" ]] || { echo "checksum mismatch: $name"; return 1; }
    off=$((off + size))
  done < /tmp/chunks/MANIFEST
  rm -f /tmp/all.bin
  mkdir -p /tmp/fa4 /tmp/vsite
  [[ -f /tmp/fa4.tar.xz ]] && (xz -d -T0 < /tmp/fa4.tar.xz | tar -xf - -C /tmp/fa4) &
  [[ -f /tmp/vllm.tar.xz ]] && (xz -d -T0 < /tmp/vllm.tar.xz | tar -xf - -C /tmp/vsite) &
  [[ -f /tmp/site.tar.xz && ! -d /tmp/site ]] && (xz -d -T0 < /tmp/site.tar.xz | tar -xf - -C /tmp) &  # Ray: /tmp/site
  for w in /tmp/*.whl; do [[ -f $w ]] && python3 -m zipfile -e "$w" /tmp/wheels; done
  wait
  touch /tmp/unbundled
}
t0=$(date +%s)
unbundle || exit 1
# the bundles are CPython 3.12's (the GPU image's): elsewhere (a CPU test of a stage) they are neither unpacked nor used
py312=$(python3 -c 'import sys; print(int(sys.version_info[:2] == (3, 12)))')
if [[ $py312 == 1 && ! -d /tmp/site && -f .device/site.tar.xz ]]; then tar -xJf .device/site.tar.xz -C /tmp || exit 1; fi
echo "unpacked in $(( $(date +%s) - t0 )) s"
if [[ $py312 == 1 ]]; then
  export PYTHONPATH=$PWD:/tmp/site:/tmp/wheels:/tmp/fa4/site:/tmp/fa4/site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
# WARM_CACHES=1: compile caches under CACHE_ROOT (/tmp), which a warm machine keeps between the calls of one block,
# so a later call starts vLLM (torch.compile, ~60 s of its 123 s start-up) and our Triton kernels from the cache.
# Bursts only: a load record's start-up figure is then not a cold start (leave it off for start-up comparisons).
# Across machines: SAVE_CACHES=1 on a measuring stage packs them into $OUT/caches.tar.xz.K when it ends (parts of
# SAVE_CACHES_PART_BYTES, 15 MB: a call brings back 8 files of 16 MiB at most); a later call carrying those parts in
# .caches/ (CACHES_IN) unpacks them once, so a fresh machine starts warm (a cold reuse pair through `ray job submit`
# takes ~580 s of a call's 600, a warm one ~460)
cr=${CACHE_ROOT:-/tmp} caches_in=${CACHES_IN:-.caches}
if compgen -G "$caches_in/caches.tar.xz.*" > /dev/null && [[ ! -f $cr/.caches-restored ]]; then
  mkdir -p "$cr" && cat $(ls "$caches_in"/caches.tar.xz.* | sort -V) | xz -d | tar -xf - -C "$cr" \
    && touch "$cr/.caches-restored" && echo "compile caches restored from $caches_in ($(du -sh "$caches_in" | cut -f1))" \
    || echo "caches not restored"
fi
export PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$cr/fa4cache
if [[ ${WARM_CACHES:-0} == 1 ]]; then export VLLM_CACHE_ROOT=$cr/vllm-cache TRITON_CACHE_DIR=$cr/triton-cache \
  TORCHINDUCTOR_CACHE_DIR=$cr/inductor-cache; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 RAY_ADDRESS=
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
VLLM=(--vllm-bin /tmp/vsite/site/bin/vllm --vllm-pythonpath /tmp/vsite/site)
nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
python3 -c 'from flash_attn.cute import flash_attn_varlen_func; print("flash-attn-4 imports")' 2>&1 | tail -1
case $stage in
  smoke)
    python3 -m pytest tests/test_gpu_engine.py tests/test_fused_kernels.py tests/test_triton_attention.py -q -x \
      2>&1 | tail -30 | tee "$OUT/smoke.log"
    timeout 420 python3 -m bench.engine.gpu_engine --out "$OUT/engine.json" "$@" 2>&1 | grep -v INFO | tail -60 ;;
  smoke-engine)
    python3 -m pytest tests/test_gpu_engine.py tests/test_fused_kernels.py -q -x 2>&1 | tail -15 | tee "$OUT/smoke.log"
    timeout 480 python3 -m bench.engine.gpu_engine --out "$OUT/engine.json" "$@" 2>&1 | grep -v INFO | tail -40 ;;
  debug-kernels)
    python3 -m pytest tests/test_gpu_engine.py tests/test_triton_attention.py -q -m gpu 2>&1 | tail -25 | tee "$OUT/smoke.log"
    timeout 300 python3 bench/engine/gpu_kernels.py --out "$OUT/kernels.json" 2>&1 | tail -45 ;;
  final)
    python3 -m pytest tests/test_gpu_engine.py -q 2>&1 | tail -6 | tee "$OUT/smoke.log"
    timeout 235 python3 -m bench.engine.gpu_engine --out "$OUT/engine.json" --parts ceilings,prefill,decode,traces,graphs \
      --max-batched 8192 --chunked 1 > "$OUT/engine.log" 2>&1; tail -3 "$OUT/engine.log"
    timeout 130 python3 -m bench.engine.spec_bench --out "$OUT/spec.json" --batches 1,4,16 --ks 2,3 --agreements 0.76 \
      --max-tokens 96 > "$OUT/spec.log" 2>&1; tail -25 "$OUT/spec.log"
    for s in prefix starvation; do
      timeout 70 python3 -m bench.load.scenarios --scenario $s --out "$OUT/scen_$s.json" > "$OUT/scen_$s.log" 2>&1
      tail -8 "$OUT/scen_$s.log"
    done ;;
  pairs)  # e.g. `pairs --systems flame,engine --traces reuse --pairs 2` (vLLM flags added)
    export RAY_ADDRESS=
    timeout 120 python3 -m pytest tests/test_gpu_service.py -q -x 2>&1 | tail -8  # pinning + service on the GPUs
    timeout 440 python3 -m bench.burst.pairs "${VLLM[@]}" "$@" --out /tmp/r 2>&1 | grep -v -e INFO -e WARNING | tail -40
    tar czf "$OUT/pairs.tgz" -C /tmp r ;;
  kernels)
    timeout 300 python3 bench/engine/gpu_kernels.py --out "$OUT/kernels.json" 2>&1 | tail -60 ;;
  engine)
    timeout 540 python3 -m bench.engine.gpu_engine --out "$OUT/engine.json" "$@" 2>&1 | grep -v INFO | tail -60 ;;
  check)  # issue 11: the new backend and scheduling on the GPU, then the decode figures
    timeout 300 python3 -m pytest tests/test_gpu_fa4.py tests/test_gpu_engine.py tests/test_fused_kernels.py -q \
      -p no:warnings > "$OUT/check.log" 2>&1
    grep -E "passed|failed|Error|assert|^E " "$OUT/check.log" | tail -30
    timeout 240 python3 -m bench.engine.gpu_engine --out "$OUT/decode.json" --parts decode > "$OUT/decode.log" 2>&1
    grep -v INFO "$OUT/decode.log" | grep -E "decode|tok_per_s|error|Error" | tail -8 ;;
  ab)  # e.g. `ab reuse '{}' '{"block_size": 128}'`: the offline split of one trace per engine config
    trace=$1
    shift
    k=0
    for cfg in "$@"; do
      timeout 200 python3 -m bench.engine.kernel_split --systems engine --traces "$trace" --warmup-rounds 1 \
        --engine-json "$cfg" --label "$cfg" --out "$OUT/ab$k-$trace.json" 2>&1 | grep -E "^engine|\|" | tail -9
      k=$((k + 1))
    done ;;
  split)  # e.g. `split --systems vllm,engine --traces no-reuse --warmup-rounds 1`: the kernel split, A-B-B-A,
    # vLLM in its own process with only its bundle's site beside this checkout (its pins differ from FA4's);
    # each run's record stays in $OUT (split.json.K-system.json) if the whole does not finish in SPLIT_TIMEOUT
    timeout ${SPLIT_TIMEOUT:-520} python3 -m bench.engine.kernel_split --vllm-pythonpath /tmp/vsite/site --measure-ceiling \
      --out "$OUT/split.json" "$@" > "$OUT/split.log" 2>&1
    grep -v -e INFO -e WARNING -e '^run ' "$OUT/split.log" | grep -e '^|' -e 'not measured' -e failed | tail -60 ;;
  burst)  # one trace's pairs in one call, e.g. `burst reuse flame,engine,vllm --pair-start 2` (flags after the
    # systems go to bench.burst.pairs; --pairs 1 unless given); SPLIT=1 first runs the offline engine on the same trace
    # (kernel split + the offline req/s that serve-http is held to). RDIR: the results dir (default /tmp/r; a
    # comparison of its own, e.g. the affinity A/B, takes another: pair indices are unique per dir and trace)
    trace=$1 systems=$2
    shift 2
    # the archive is named by RDIR and trace: two stages of one `bg seq` with other RDIRs must not overwrite it
    rdir=${RDIR:-/tmp/r}
    if [[ ${SPLIT:-0} == 1 ]]; then
      timeout 200 python3 -m bench.engine.kernel_split --systems engine --traces "$trace" --out "$OUT/split-$trace.json" \
        2>&1 | grep -v -e INFO -e WARNING | tail -12
    fi
    timeout ${PAIRS_TIMEOUT:-540} python3 -m bench.burst.pairs --systems "$systems" --traces "$trace" --pairs 1 "${VLLM[@]}" \
      --out "$rdir" "$@" 2>&1 | grep -v -e INFO -e WARNING | tail -30
    tar czf "$OUT/pairs-$(basename "$rdir")-$trace.tgz" -C "$(dirname "$rdir")" "$(basename "$rdir")" ;;
  jobpairs)  # burst's pairs as users run them, e.g. `jobpairs reuse flame,engine,vllm --pair-start 0`: a Ray head
    # started here (all GPUs), bench.burst.pairs through `ray job submit --working-dir .`, the job's logs fetched into
    # RDIR/jobs/, the head stopped (bench/burst/jobpairs.py); every raw record and the report say "ray job submit"
    trace=$1 systems=$2
    shift 2
    rdir=${RDIR:-/tmp/r} limit=${PAIRS_TIMEOUT:-480}  # the job's; the head's start and stop take ~1 minute more
    timeout $((limit + 60)) python3 -m bench.burst.jobpairs --out "$rdir" --timeout-s "$limit" \
      -- --systems "$systems" --traces "$trace" --pairs 1 "${VLLM[@]}" "$@" 2>&1 | grep -v -e INFO -e WARNING | tail -40
    tar czf "$OUT/pairs-$(basename "$rdir")-$trace.tgz" -C "$(dirname "$rdir")" "$(basename "$rdir")" ;;
  load)  # sustained load through each system's OpenAI endpoint, e.g. `load --systems flame,vllm --rates 2,4,8
    # --duration-s 30` (one system after another; bench.load.load_report DIR merges calls into one report)
    timeout ${LOAD_TIMEOUT:-560} python3 -m bench.burst.pairs --mode load "${VLLM[@]}" --out /tmp/load "$@" 2>&1 \
      | grep -v -e INFO -e WARNING | tail -45
    tar czf "$OUT/load.tgz" -C /tmp load ;;
  mlperf)  # MLPerf LoadGen (bench/load/mlperf.py; MLPerf-style, not a submission), e.g. `mlperf --systems flame,vllm
    # --scenario offline,server --find-qps --mlperf-samples 1000` (one system after another; calls into one --out
    # merge: MLPERF_DIR). LoadGen travels as its wheel: .whl/mlcommons_loadgen-*.whl in the bundles (unpacked to
    # /tmp/wheels) or carried in .whl/ with the call (bg's copy of the tree leaves .whl/ out: there LoadGen imports
    # only once an earlier call unpacked it; the GPU image's Python is 3.12: the cp312 wheel). $OUT: loadgen.md, and
    # mlperf.tgz (the report's JSON, each system's record and every LoadGen run's summary and detail logs)
    if ! python3 -c 'import mlperf_loadgen' 2>/dev/null; then
      for w in .whl/mlcommons_loadgen-*.whl; do [[ -f $w ]] && python3 -m zipfile -e "$w" /tmp/wheels; done
    fi
    python3 -c 'import mlperf_loadgen' 2>/dev/null || {
      echo "no MLPerf LoadGen here: pip download mlcommons-loadgen==6.0.17 --no-deps -d .whl (this machine's Python)"
      exit 5; }
    mdir=${MLPERF_DIR:-/tmp/mlperf}
    timeout ${MLPERF_TIMEOUT:-560} python3 -m bench.burst.pairs --mode loadgen "${VLLM[@]}" --out "$mdir" "$@" 2>&1 \
      | grep -v -e INFO -e WARNING | tail -45
    st=${PIPESTATUS[0]}
    cp "$mdir/loadgen.md" "$OUT/" 2>/dev/null
    tar czf "$OUT/mlperf.tgz" -C "$(dirname "$mdir")" "$(basename "$mdir")"
    (exit "$st") ;;
  py)  # any module or script with the bundles' packages, e.g. `py -m bench.engine.flag_ab --flag prune_last_layer --out \$OUT/prune.json`
    timeout ${PY_TIMEOUT:-540} python3 "$@" 2>&1 | grep -v -e INFO -e WARNING | tail -60 ;;
  bg)  # any stage in a process session of its own, so it runs on after this call returns (the device tool ends a
    # call's leftover processes, except a new session's, and keeps them while the machine stays warm): e.g.
    # `PAIRS_TIMEOUT=1500 bg jobpairs reuse flame,engine,vllm,vllm-seed --pair-start 1 --pairs 2`, then `wait` calls
    # back to back (a pair of four systems on reuse takes ~9.5 minutes, past one call's 10). BG_DIR: its log, exit
    # status and $OUT (default /tmp/bg)
    bg=${BG_DIR:-/tmp/bg}
    [[ -f $bg/pid && ! -f $bg/rc ]] && kill -0 "$(cat "$bg/pid")" 2>/dev/null && { echo "a background stage runs"; exit 3; }
    rm -rf "$bg" && mkdir -p "$bg/out" "$bg/tree"
    # it runs in a copy of the tree: each later call copies the working tree here again, under a running stage
    tar cf - --exclude=./.git --exclude='./.bundle*' --exclude=./.fa4 --exclude=./.vllm --exclude=./.whl \
      --exclude=./.gl --exclude=./.caches --exclude=./out . | tar xf - -C "$bg/tree" || exit 1
    cd "$bg/tree" || exit 1
    OUT=$bg/out setsid bash -c 'echo $$ > "$0/pid"; bash bench/device_run.sh "$@" > "$0/log" 2>&1; echo $? > "$0/rc"' \
      "$bg" "$@" < /dev/null > /dev/null 2>&1 &
    for _ in {1..50}; do [[ -s $bg/pid ]] && break; sleep 0.1; done
    echo "started in the background (pid $(cat "$bg/pid")): $*" ;;
  seq)  # stages in turn, one argument each, words split at spaces, leading NAME=value words its environment, e.g.
    # `bg seq 'burst no-reuse flame,engine,vllm,vllm-seed --pair-start 2' 'PAIRS_TIMEOUT=1500 jobpairs reuse ...'`
    # (a block's whole measurement in one background stage: no gap between stages). Goes on past a failed stage;
    # its status is the last failure's
    rc=0
    for line in "$@"; do
      read -ra words <<< "$line"
      envs=()
      while (( ${#words[@]} )) && [[ ${words[0]} =~ ^[A-Z_][A-Z0-9_]*= ]]; do envs+=("${words[0]}"); words=("${words[@]:1}"); done
      echo "== stage: $line"
      env SAVE_CACHES=0 "${envs[@]}" bash bench/device_run.sh "${words[@]}" || rc=$?  # saved once, at its end
    done
    exit $rc ;;
  wait)  # until the background stage ends (looked for every WAIT_POLL_S, 5) or WAIT_S (560) pass; prints its
    # log's end, and brings back its $OUT (what its finished stages wrote there), and while it runs RDIR so far too
    # (progress.tgz: every finished run's raw record)
    bg=${BG_DIR:-/tmp/bg} deadline=$(( $(date +%s) + ${WAIT_S:-560} ))
    [[ -f $bg/pid ]] || { echo "no background stage"; exit 3; }
    while [[ ! -f $bg/rc ]] && (( $(date +%s) < deadline )) && kill -0 "$(cat "$bg/pid")" 2>/dev/null; do sleep "${WAIT_POLL_S:-5}"; done
    grep -v -e INFO -e WARNING "$bg/log" | tail -40
    if [[ -f $bg/rc ]]; then
      cp -r "$bg/out/." "$OUT/"
      echo "background stage ended: rc $(cat "$bg/rc")"
    elif ! kill -0 "$(cat "$bg/pid")" 2>/dev/null; then
      cp -r "$bg/out/." "$OUT/"
      echo "background stage gone without an exit status"; exit 4
    else
      cp -r "$bg/out/." "$OUT/"
      rdir=${RDIR:-/tmp/r}
      [[ -d $rdir ]] && tar czf "$OUT/progress.tgz" -C "$(dirname "$rdir")" "$(basename "$rdir")"
      echo "background stage still running"
    fi ;;
  sleep)  # hold the warm machine (and its unpacked /tmp) while a fix is made here
    sleep "${1:-60}" ;;
  external)  # issue 41: `vllm bench serve` unchanged against each of DOORS in turn, on one GPU: serve-http (our engine
    # alone), serve (`flame-llm serve`: local Ray, one engine actor per GPU, the front door actor) and vllm (`vllm
    # serve`); DOORS defaults to serve-http,vllm, e.g. DOORS=serve-http,serve,vllm for both of ours beside vLLM's.
    # MODEL (default the 8B dummy-weight llama config, dummy weights) with the embedded tiny BPE as every server's
    # tokenizer (no HF tokenizer is on the device); SERVICE_JSON: fields merged into serve's service config (e.g.
    # placement for a CPU run); ports EXTERNAL_PORT (8101), +1 (vllm), +2 (serve). Flags after it go to
    # bench.load.external_clients, e.g.
    # `bg external --num-prompts 200 --input-len 1024 --output-len 256 --rate 4 --rate 8 --rate 16 --rate inf`
    model=${MODEL:-configs/models/llama-3.1-8b} seqs=${MAX_NUM_SEQS:-256} len=${MAX_MODEL_LEN:-4096}
    doors=${DOORS:-serve-http,vllm} port=${EXTERNAL_PORT:-8101} vsite=${VLLM_SITE:-/tmp/vsite/site}
    for door in ${doors//,/ }; do
      [[ $door =~ ^(serve-http|serve|vllm)$ ]] || { echo "unknown door $door in DOORS (serve-http, serve, vllm)"; exit 2; }
    done
    tok=$(python3 -c 'from flame_llm.models.tokenizer import tokenizer_dir; print(tokenizer_dir("", "tiny"))') || exit 1
    up() {  # $1 answers /health (900 s at most), while the server $2 runs
      for _ in $(seq 900); do
        curl -sf "$1/health" > /dev/null && return 0
        kill -0 "$2" 2>/dev/null || { echo "the server at $1 exited before it answered"; return 1; }
        sleep 1
      done
      return 1; }
    clients() { timeout "${EXTERNAL_TIMEOUT:-1500}" python3 -m bench.load.external_clients --client vllm --target "$1" \
      --tokenizer "$tok" --vllm-site "$vsite" --out "$OUT/external" "${@:2}" 2>&1 | tail -20; }
    rc=0
    for door in ${doors//,/ }; do
      case $door in
        serve-http)
          url=http://127.0.0.1:$port
          setsid python3 -m flame_llm.serving.http_server --model "$model" --load-format dummy --tokenizer "$tok" \
            --port "$port" --engine-json "{\"max_model_len\": $len, \"max_num_seqs\": $seqs}" \
            > "$OUT/flame-server.log" 2>&1 & ;;
        serve)
          url=http://127.0.0.1:$((port + 2))
          python3 -c 'import json, sys, yaml
cfg = {"model": sys.argv[1], "tokenizer": sys.argv[2], "engine": {"load_format": "dummy", "max_model_len": int(
    sys.argv[3]), "max_num_seqs": int(sys.argv[4])}, "ray": {"namespace": "flame-external"}}
for k, v in json.loads(sys.argv[5]).items():
    cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
yaml.safe_dump(cfg, open(sys.argv[6], "w"))' "$model" "$tok" "$len" "$seqs" "${SERVICE_JSON:-{\}}" \
            "$OUT/external-service.yaml" || exit 1
          setsid python3 -m flame_llm.cli serve --config "$OUT/external-service.yaml" --host 127.0.0.1 \
            --http-port $((port + 2)) > "$OUT/flame-service.log" 2>&1 & ;;
        vllm)
          url=http://127.0.0.1:$((port + 1))
          PYTHONPATH=$vsite:$PYTHONPATH setsid "$vsite/bin/vllm" serve "$model" --load-format dummy \
            --tokenizer "$tok" --port $((port + 1)) --max-model-len "$len" --max-num-seqs "$seqs" \
            --enable-prefix-caching --seed 0 > "$OUT/vllm-server.log" 2>&1 & ;;
      esac
      pid=$!
      if up "$url" "$pid"; then clients "$url" "$@" || rc=1; else echo "$door did not come up"; rc=1; fi
      # serve stops its shards and the Ray it started on SIGTERM: give it the time, then end what is left
      kill "$pid" 2>/dev/null
      for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
      kill -- -"$pid" 2>/dev/null; wait "$pid"
    done
    cat "$OUT/external/summary.jsonl" || rc=1
    # a run with a failed request, or one our /metrics did not count, fails the stage
    python3 -c 'import json, sys
bad = [r for r in map(json.loads, open(sys.argv[1])) if r["failed"] or r["server_not_ok"]
       or r["server_answered_200"] not in (None, r["completed"])]
print(f"{len(bad)} run(s) with failed requests or a count our /metrics disagrees with" if bad else "every run ok")
sys.exit(1 if bad else 0)' "$OUT/external/summary.jsonl" || rc=1
    (exit $rc) ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
rc=$?
if [[ ${SAVE_CACHES:-0} == 1 && ! $stage =~ ^(bg|wait|sleep)$ ]]; then
  dirs=()
  for d in vllm-cache triton-cache inductor-cache fa4cache; do [[ -d $cr/$d ]] && dirs+=("$d"); done
  if (( ${#dirs[@]} )); then
    tar -cf - -C "$cr" "${dirs[@]}" | xz -T0 -3 | split -b "${SAVE_CACHES_PART_BYTES:-15000000}" -d -a 1 - "$OUT/caches.tar.xz."
    n=$(ls "$OUT"/caches.tar.xz.* | wc -l) bytes=$(cat "$OUT"/caches.tar.xz.* | wc -c)
    sizes=$(du -sh "${dirs[@]/#/$cr/}" | tr '\t\n' ': ')
    # a call brings back 8 files: more parts than SAVE_CACHES_MAX_PARTS (6, beside the stage's own archives) would
    # come back incomplete, which restores nothing
    if (( n > ${SAVE_CACHES_MAX_PARTS:-6} )); then
      rm -f "$OUT"/caches.tar.xz.*
      echo "compile caches not saved: $bytes bytes would take $n parts, over ${SAVE_CACHES_MAX_PARTS:-6} ($sizes)"
    else
      echo "compile caches saved: $bytes bytes in $n part(s) (${dirs[*]}; $sizes)"
    fi
  else
    echo "no compile caches under $cr to save (WARM_CACHES=1 puts them there)"
  fi
fi
exit $rc
