#!/usr/bin/env bash
# Rewrite the study's tables and plots from the runs that have finished, and copy them here:
#   bash docs/reproduction/study_tables.sh RUNS_DIR     (the directory study.sh was given)
# -> docs/reproduction/study/{wiki,wiki-3000steps-d256,shakespeare,wiki-followups,wiki-newlayers}/{results.json,results.md,*.png}
set -euo pipefail
R=${1:?usage: study_tables.sh RUNS_DIR}
MOEIFY=${MOEIFY:-moeify}
here=$(cd "$(dirname "$0")" && pwd)
for corpus in wiki wiki-3000steps-d256 shakespeare wiki-followups wiki-newlayers; do
  [ -d "$R/$corpus/runs" ] || continue
  "$MOEIFY" sweep --tabulate --out "$R/$corpus" > /dev/null || { echo "nothing finished in $R/$corpus"; continue; }
  mkdir -p "$here/study/$corpus"
  for f in results.json results.md valid_curves.png gaps.png routing.png; do
    if [ -f "$R/$corpus/$f" ]; then cp "$R/$corpus/$f" "$here/study/$corpus/$f"; fi
  done
done
