#!/usr/bin/env bash
# Raw benchmark records live on the orphan branch `results`, not in main's tree (bench/README.md says why):
#   bash bench/records.sh commit DIR     add the raw records under DIR (a run dir below bench/results) to `results`
#   bash bench/records.sh restore [PATH] check them back out under PATH (default bench/results) for `flame-llm report`
#   bash bench/records.sh list [PATH]    run dirs with record counts and bytes; with PATH below a run, its files
#   bash bench/records.sh attach         merge `results` into the checked-out branch keeping its tree (-s ours), so
#                                        a clone of main carries the records (only main lands) without the branch
# Raw records are what .gitignore keeps out of main: files under raw/ or logs/, *.gz, *.xz, *.zst and *.log below
# bench/results.
# `commit` writes the branch through a private index (git commit-tree), so the checkout, its index and HEAD are
# untouched; the first commit makes the orphan branch. Without the branch (a fresh clone of main), every command
# reads the records from main's history: the second parent of its newest "records: " merge (`attach`).
set -euo pipefail
BRANCH=${RECORDS_BRANCH:-results}
cmd=${1:-}
shift || true
root=$(git rev-parse --show-toplevel)
cd "$root"

raw_files() {  # the raw records under $1, relative to the repo root (the .gitignore patterns, once)
  find "$1" -type f \( -path '*/raw/*' -o -path '*/logs/*' -o -name '*.gz' -o -name '*.xz' -o -name '*.zst' \
    -o -name '*.log' \) | sort
}

branch_ref() { git rev-parse -q --verify "refs/heads/$BRANCH^{commit}" 2> /dev/null; }

records_ref() {  # the records' newest commit: the branch, else the second parent of HEAD's newest "records: " merge
  branch_ref && return 0
  local m
  m=$(git log --merges --format=%H --grep='^records: ' -1 HEAD 2> /dev/null)
  [[ -n $m ]] && git rev-parse "$m^2"
}

has_branch() { [[ -n $(records_ref) ]]; }

rel() {  # a path relative to the repo root, whether given from the root or from the caller's directory
  local p=${1%/}
  [[ $p == /* ]] && p=${p#"$root"/}
  echo "$p"
}

case $cmd in
  commit)
    dir=$(rel "${1:?usage: records.sh commit DIR}")
    [[ -d $dir ]] || { echo "records.sh: no directory $dir" >&2; exit 2; }
    [[ $dir == bench/results || $dir == bench/results/* ]] \
      || { echo "records.sh: $dir is not below bench/results" >&2; exit 2; }
    mapfile -t files < <(raw_files "$dir")
    [[ ${#files[@]} -gt 0 ]] \
      || { echo "records.sh: no raw records under $dir (raw/, logs/, *.gz, *.xz, *.zst, *.log)" >&2; exit 2; }
    idx=$(mktemp)
    trap 'rm -f "$idx"' EXIT
    parent=()
    base=$(records_ref || true)
    if [[ -n $base ]]; then
      GIT_INDEX_FILE=$idx git read-tree "$base"
      parent=(-p "$base")
    else
      rm -f "$idx"  # an empty index: the first commit of an orphan branch
    fi
    printf '%s\0' "${files[@]}" | GIT_INDEX_FILE=$idx git update-index --add -z --stdin
    tree=$(GIT_INDEX_FILE=$idx git write-tree)
    if [[ -n $base && $tree == $(git rev-parse "$base^{tree}") ]]; then
      echo "records.sh: $dir already on $BRANCH unchanged"
      exit 0
    fi
    src=$(git rev-parse --short HEAD 2> /dev/null || echo none)
    commit=$(git commit-tree "$tree" "${parent[@]}" -m "records: $dir (${#files[@]} files; main at $src)")
    git update-ref "refs/heads/$BRANCH" "$commit"
    echo "records.sh: $BRANCH $(git rev-parse --short "$commit"): ${#files[@]} files of $dir"
    ;;
  restore)
    path=$(rel "${1:-bench/results}")
    has_branch || { echo "records.sh: no branch $BRANCH and no records: merge in HEAD's history" >&2; exit 2; }
    BRANCH=$(records_ref)
    [[ -n $(git ls-tree -r --name-only "$BRANCH" -- "$path" | head -1) ]] \
      || { echo "records.sh: nothing under $path on $BRANCH" >&2; exit 2; }
    git archive --format=tar "$BRANCH" -- "$path" | tar -xf - -C "$root"
    echo "records.sh: restored $(git ls-tree -r --name-only "$BRANCH" -- "$path" | wc -l) files under $path"
    ;;
  list)
    path=$(rel "${1:-bench/results}")
    has_branch || { echo "records.sh: no branch $BRANCH and no records: merge in HEAD's history" >&2; exit 2; }
    BRANCH=$(records_ref)
    if [[ $path == bench/results ]]; then  # one line a run: its dir (what precedes raw/ or logs/), files, bytes
      git ls-tree -r -l "$BRANCH" -- "$path" | awk '{ k = $5; if (!sub("/(raw|logs)/.*$", "", k)) sub("/[^/]*$", "", k)
        n[k]++; b[k] += $4 } END { for (k in n) printf "%s\t%d files\t%d bytes\n", k, n[k], b[k] }' \
        | sort
    else
      git ls-tree -r -l "$BRANCH" -- "$path" | awk '{ printf "%s\t%d bytes\n", $5, $4 }'
    fi
    ;;
  attach)
    ref=$(branch_ref) || { echo "records.sh: no branch $BRANCH to attach" >&2; exit 2; }
    if git merge-base --is-ancestor "$ref" HEAD; then
      echo "records.sh: $BRANCH $(git rev-parse --short "$ref") is already in HEAD's history"
      exit 0
    fi
    git merge -q -s ours --allow-unrelated-histories --no-edit -m "records: $BRANCH $(git rev-parse --short "$ref") joined to the history (tree unchanged)" "$ref"
    echo "records.sh: HEAD $(git rev-parse --short HEAD) carries $BRANCH $(git rev-parse --short "$ref")"
    ;;
  *)
    sed -n 2,8p "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
