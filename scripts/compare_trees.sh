#!/usr/bin/env bash
# The CPU benchmark ratios of docs/benchmarks/index.md from two source trees, alternating in one session, so that
# a refactoring can be held to "every ratio unchanged or better" on the same machine:
#     bash scripts/compare_trees.sh OLD_SRC NEW_SRC OUT [RUNS]
# OLD_SRC / NEW_SRC are `src` folders (e.g. of a `git worktree add --detach` of the old
# commit); each run times old then new with the benchmarks of docs/benchmarks/run.sh (fewer
# repeats), writing OUT/{old,new}_{ff,attention,generate,step}_RUN.json; then
# scripts/compare_trees.py OUT prints the medians side by side.
set -euo pipefail
old=$1 new=$2 out=$3 runs=${4:-2}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
threads=(--threads 2)
bench() {  # bench TREE NAME RUN ARGS...
  local tree=$1 name=$2 run=$3 src
  shift 3
  src=$([ "$tree" = old ] && echo "$old" || echo "$new")
  PYTHONPATH="$src" "$py" -m moeify.cli.main bench "$@" --json > "$out/$tree.$name.$run.tmp"
  mv "$out/$tree.$name.$run.tmp" "$out/${tree}_${name}_$run.json"
}
for r in $(seq 1 "$runs"); do
  for tree in old new; do
    echo "run $r: $tree" >&2
    bench "$tree" ff "$r" ff --repeats 3 "${threads[@]}"
    bench "$tree" attention "$r" attention --preset wt103-47m-dense \
      --preset wt103-47m-switchhead --preset wt103-47m-moa-h4 --no-textbook --no-memory \
      --repeats 5 "${threads[@]}"
    bench "$tree" generate "$r" generate --preset wt103-47m-dense \
      --preset wt103-47m-switchhead --context 2048 --batch 1 --batch 8 --tokens 8 \
      "${threads[@]}"
    bench "$tree" step "$r" step --preset wt103-47m-dense --preset wt103-47m-switchhead \
      --batch 4 --repeats 2 --warmup 1 --no-memory "${threads[@]}"
  done
done
"$py" scripts/compare_trees.py "$out"
