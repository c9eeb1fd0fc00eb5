#!/usr/bin/env bash
# Packs the GPU machine's missing packages (built by ../shared/tools: fa4-bundle -> .fa4/part_*, vllm-bundle
# -> .vllm/part_*, device-bundle -> .device/site.tar.xz (Ray, 47 MB), plus wheels in .whl/, e.g. zstandard)
# into as few device calls as the 64 MiB limit allows: the archives are concatenated and cut into .bundle0/,
# .bundle1/, ... (one chunk each), with a MANIFEST (name, bytes, sha256 of each archive) in the last. Ray
# travels in the chunks too, so no call carries it beside the tree (which grew past what that left room
# for). Each call carries one folder;
# `bash bench/device_run.sh take K` moves chunk K aside on the machine, and the first other stage
# reassembles, checks and unpacks them (a warm machine keeps /tmp between calls).
#
# usage: bash bench/device_bundles.sh [chunk MB]   (from the repo root, after the bundles exist; default: what
# the 64 MiB a call may carry leaves beside the tree that travels with it, less HEADROOM_MB (3) for the records
# that later sessions commit: with 1 MB, chunks cut one session were refused the next)
#        bash bench/device_bundles.sh check        (before a block of calls: does each chunk still fit beside
# today's tree? a refused call costs nothing, but a machine started by the calls before it idles away meanwhile)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
limit=67108864
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
if [[ ${1:-} == check ]]; then
  bad=0 n=0
  for d in .bundle[0-9]; do
    [[ -d $d ]] || continue
    n=$((n + 1))
    size=$(( tree + $(du -sb "$d" | cut -f1) ))
    if (( size > limit )); then
      echo "$d: the tree ($tree bytes) and the chunk carry $size bytes, over the $limit a call carries;" \
        "cut the chunks again: bash bench/device_bundles.sh"
      bad=1
    fi
  done
  (( n )) || { echo "no chunks (.bundle0, ...): run bash bench/device_bundles.sh"; exit 1; }
  (( bad )) || echo "$n chunks, each fits beside the $tree-byte tree (limit $limit bytes a call)"
  exit $bad
fi
mb=${1:-$(( (limit - tree) / 1000000 - ${HEADROOM_MB:-3} ))}
echo "tree $((tree / 1000000)) MB travels with every call: chunks of $mb MB"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
names=()
if [[ -f .fa4/part_00 ]]; then cat .fa4/part_* > "$work/fa4.tar.xz"; names+=(fa4.tar.xz); fi
if [[ -f .vllm/part_00 ]]; then cat .vllm/part_* > "$work/vllm.tar.xz"; names+=(vllm.tar.xz); fi
if [[ -f .device/site.tar.xz ]]; then cp .device/site.tar.xz "$work/site.tar.xz"; names+=(site.tar.xz); fi
for w in .whl/*.whl; do [[ -f $w ]] && cp "$w" "$work/" && names+=("$(basename "$w")"); done
(( ${#names[@]} )) || { echo "no bundles found (.fa4, .vllm, .device, .whl)"; exit 1; }
: > "$work/MANIFEST"
for n in "${names[@]}"; do
  echo "$n $(stat -c %s "$work/$n") $(sha256sum < "$work/$n" | cut -d' ' -f1)" >> "$work/MANIFEST"
done
for n in "${names[@]}"; do cat "$work/$n"; done | split -b "${mb}000000" -d -a 1 - "$work/chunk_"
rm -rf .bundle[0-9]
k=0
for c in "$work"/chunk_*; do
  mkdir -p ".bundle$k" && mv "$c" ".bundle$k/"
  grep -qxF "/.bundle$k/" .git/info/exclude 2>/dev/null || echo "/.bundle$k/" >> .git/info/exclude
  k=$((k + 1))
done
cp "$work/MANIFEST" ".bundle$((k - 1))/"
cat ".bundle$((k - 1))/MANIFEST"
ls -l .bundle*/
