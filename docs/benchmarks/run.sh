#!/usr/bin/env bash
# The CPU benchmark tables of docs/benchmarks/index.md: every run of every table, as JSON, in this folder.
# Run from the repository root after `make setup` (and `pip install transformers` for the
# Hugging Face rows of bench ff), on a machine with nothing else running:
#     bash docs/benchmarks/run.sh [RUNS [FIRST]]
# Each benchmark measures its cases side by side in one process; RUNS (default 5) repeats
# the whole set, so each ratio has a median over runs; FIRST (default 1) numbers the first
# run, to add runs to those already here (the files here: `run.sh`, then `run.sh 5 6` a day
# later). About 3-4 minutes per run on 2 cores. A file is
# written only once its benchmark has finished.
set -euo pipefail
out=docs/benchmarks
runs=${1:-5}
first=${2:-1}
moeify=${MOEIFY:-.venv/bin/moeify}
threads=(--threads 2)
bench() {  # bench NAME RUN ARGS...: moeify bench ARGS --json, kept as NAME_RUN.json
  local name=$1 run=$2
  shift 2
  "$moeify" bench "$@" --json > "$out/$name.$run.tmp"
  mv "$out/$name.$run.tmp" "$out/${name}_$run.json"
}
for r in $(seq "$first" $((first + runs - 1))); do
  echo "run $r" >&2
  bench ff "$r" ff --repeats 5 "${threads[@]}"
  bench generate "$r" generate --preset wt103-47m-dense --preset wt103-47m-switchhead \
    --preset wt103-47m-moa-h4 --context 2048 --batch 1 --batch 8 --tokens 16 \
    "${threads[@]}"
  if [ "$r" = 1 ]; then  # peak memory is deterministic: measured once
    bench attention "$r" attention --repeats 9 "${threads[@]}"
    bench step "$r" step --preset wt103-47m-dense --preset wt103-47m-switchhead --batch 4 \
      --repeats 3 --warmup 1 "${threads[@]}"
  else
    bench attention "$r" attention --preset wt103-47m-dense --preset wt103-47m-switchhead \
      --preset wt103-47m-moa-h4 --no-textbook --no-memory --repeats 9 "${threads[@]}"
    bench step "$r" step --preset wt103-47m-dense --preset wt103-47m-switchhead --batch 4 \
      --repeats 3 --warmup 1 --no-memory "${threads[@]}"
  fi
done
# Where the 47M layers' forward+backward goes, by operation (GEMMs vs the rest), once.
"$moeify" bench attention --preset wt103-47m-dense --preset wt103-47m-switchhead --no-textbook \
  --no-memory --repeats 5 --ops 15 "${threads[@]}" --json > "$out/attention-ops.tmp"
mv "$out/attention-ops.tmp" "$out/attention-ops.json"
.venv/bin/python docs/benchmarks/summary.py > "$out/summary.md.tmp"
mv "$out/summary.md.tmp" "$out/summary.md"
