#!/usr/bin/env bash
# py-spy on the standalone engine (serve-http) during load windows (issue 39: where the engine process's threads
# hold the GIL under load). Start it in the background beside a load call that exports LOAD_WINDOW_MARK:
#   LOAD_WINDOW_MARK=/tmp/window.mark bash bench/service/spy_load.sh $OUT 15 engine engine-gil &
#   LOAD_WINDOW_MARK=/tmp/window.mark ... bash bench/device_run.sh load --systems engine,engine-gil,vllm ...
# For each label, once its window starts: SECS s of raw stacks of the threads holding the GIL (--gil), then 8 s of
# every thread, idle ones included. Files: OUT/spy-LABEL-gil.txt and OUT/spy-LABEL-all.txt (py-spy's raw format).
set -u
out=${1:?out dir} secs=${2:?seconds} && shift 2
mark=${LOAD_WINDOW_MARK:?LOAD_WINDOW_MARK}
for label in "$@"; do
  until [[ -f $mark ]] && grep -q "^$label " "$mark"; do sleep 0.5; done
  sleep 3
  pid=$(pgrep -f -n flame_llm.serving.http_server) || { echo "spy: no serve-http for $label"; continue; }
  py-spy record -p "$pid" -d "$secs" -r 100 -f raw --threads --gil --nonblocking -o "$out/spy-$label-gil.txt" \
    > /dev/null 2>&1 || echo "spy: py-spy --gil failed for $label"
  py-spy record -p "$pid" -d 8 -r 100 -f raw --threads --idle --nonblocking -o "$out/spy-$label-all.txt" \
    > /dev/null 2>&1 || echo "spy: py-spy failed for $label"
done
