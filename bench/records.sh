#!/usr/bin/env bash
# Raw benchmark records live on the orphan branch `results`, not in main's tree (bench/README.md says why):
#   bash bench/records.sh commit DIR     add the raw records under DIR (a run dir below bench/results) to `results`
#   bash bench/records.sh restore [PATH] check them back out under PATH (default bench/results) for `flame-llm report`
#   bash bench/records.sh list [PATH]    run dirs with record counts and bytes; with PATH below a run, its files
# Raw records are what .gitignore keeps out of main: files under raw/ or logs/, *.gz, *.xz, *.zst and *.log below
# bench/results.
# `commit` writes the branch through a private index (git commit-tree), so the checkout, its index and HEAD are
# untouched; the first commit makes the orphan branch. After a clone: `git fetch origin results:results`.
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

has_branch() { git rev-parse -q --verify "refs/heads/$BRANCH^{commit}" > /dev/null; }

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
    if has_branch; then
      GIT_INDEX_FILE=$idx git read-tree "$BRANCH"
      parent=(-p "$BRANCH")
    else
      rm -f "$idx"  # an empty index: the first commit of an orphan branch
    fi
    printf '%s\0' "${files[@]}" | GIT_INDEX_FILE=$idx git update-index --add -z --stdin
    tree=$(GIT_INDEX_FILE=$idx git write-tree)
    if has_branch && [[ $tree == $(git rev-parse "$BRANCH^{tree}") ]]; then
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
    has_branch || { echo "records.sh: no branch $BRANCH (git fetch origin $BRANCH:$BRANCH)" >&2; exit 2; }
    [[ -n $(git ls-tree -r --name-only "$BRANCH" -- "$path" | head -1) ]] \
      || { echo "records.sh: nothing under $path on $BRANCH" >&2; exit 2; }
    git archive --format=tar "$BRANCH" -- "$path" | tar -xf - -C "$root"
    echo "records.sh: restored $(git ls-tree -r --name-only "$BRANCH" -- "$path" | wc -l) files under $path"
    ;;
  list)
    path=$(rel "${1:-bench/results}")
    has_branch || { echo "records.sh: no branch $BRANCH" >&2; exit 2; }
    if [[ $path == bench/results ]]; then  # one line a run: its dir (what precedes raw/ or logs/), files, bytes
      git ls-tree -r -l "$BRANCH" -- "$path" | awk '{ k = $5; if (!sub("/(raw|logs)/.*$", "", k)) sub("/[^/]*$", "", k)
        n[k]++; b[k] += $4 } END { for (k in n) printf "%s\t%d files\t%d bytes\n", k, n[k], b[k] }' \
        | sort
    else
      git ls-tree -r -l "$BRANCH" -- "$path" | awk '{ printf "%s\t%d bytes\n", $5, $4 }'
    fi
    ;;
  *)
    sed -n 2,6p "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
