#!/usr/bin/env bash
# The GPU check, one command, in the order that matters (each phase under its own time limit,
# the phases under TOTAL_LIMIT, 465 s: a phase gets the smaller of its limit and the time
# left), then one JSON and one markdown table of every ratio beside the paper's (SwitchHead
# Table 5: 47M 0.72x time, 0.65x memory; 262M 0.65x, 0.61x) and moeify's targets
# (scripts/gpu_summary.py):
#
#   a kernels     every expert kernel ("concat", "concat_saved", "triton" included) and both
#                 equal-MAC baselines at the 47M and 262M SwitchHead value and output
#                 shapes, each output checked against the reference; writes
#                 kernel-table.json, the device table that expert_impl=auto reads (commit it
#                 as src/moeify/ops/moe/tables/<class>.json); then the Triton kernels
#                 without their width padding, and one profiled call
#   b attention   the 47M and 262M attention layers, dense and SwitchHead with each kernel forced
#                 and "auto"
#   c step        the 47M and 262M training steps: eager, compiled, CUDA graphs (reduce-overhead)
#   d ff          the feedforward MoEs against Hugging Face's Mixtral experts
#   e suite       pytest -m cuda, then the Triton kernel tests on the device
#   f peer        the SwitchHead authors' CVMM beside moeify's kernels (CVMM=PATH)
#
# Triton's autotuning is off (MOEIFY_TRITON_AUTOTUNE=0: each kernel's first configuration)
# except in phase a, where it is part of what is timed (during the warm-up).
#
#   scripts/gpu_check.sh                    everything (at most 8 minutes on one H100)
#   DEVICE=cuda:1 scripts/gpu_check.sh      another GPU (the run is labelled by its real name)
#   SKIP_SUITE=1 ...                        no phase e
#   BATCH=32 REPEATS=5 ...                  step batch (default 64, the paper's), repeats (3)
#   CVMM=moeut/moeut/cvmm.py ...            phase f: the authors' cvmm.py, from
#                                           github.com/RobertCsordas/moeut
#   SMOKE=1 scripts/gpu_check.sh            every phase end to end on the CPU at tiny shapes,
#                                           in seconds (what CI runs: the script's own check)
#
# Python: .venv/bin/python when there is one, else python3, with this checkout's src/ on
# PYTHONPATH (a lent GPU machine has its own python3 with torch and no package index: nothing
# is installed). JSON results and logs go to $OUT_DIR (default gpu-check/). Exit status: the
# suite's (0 when skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export MOEIFY_TRITON_AUTOTUNE=0
OUT_DIR=${OUT_DIR:-gpu-check}
SMOKE=${SMOKE:-${SMALL:-}}
if [ -n "$SMOKE" ]; then DEVICE=${DEVICE:-cpu}; else DEVICE=${DEVICE:-cuda}; fi
BATCH=${BATCH:-64}
REPEATS=${REPEATS:-3}
# 8 minutes less the device query and the summary; the smoke run checks the script, not the
# time, so its limits are LIMIT_SCALE (default 8) times longer (a CPU shared with other jobs).
if [ -n "$SMOKE" ]; then LIMIT_SCALE=${LIMIT_SCALE:-8}; else LIMIT_SCALE=${LIMIT_SCALE:-1}; fi
TOTAL_LIMIT=${TOTAL_LIMIT:-$((465 * LIMIT_SCALE))}
mkdir -p "$OUT_DIR"
MOEIFY=("$PY" -m moeify.cli.main)
cuda=""
case "$DEVICE" in cuda*) cuda=1 ;; esac

if [ -n "$cuda" ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $PY; nothing to check (SMOKE=1 checks the script)" >&2
    exit 2
fi
"$PY" - "$DEVICE" > "$OUT_DIR/device.json" <<'PYEOF'
import json, sys, torch
dev = torch.device(sys.argv[1])
try:
    import triton
    tri = triton.__version__
except ImportError:
    tri = None
cuda = dev.type == "cuda"
index = dev.index if dev.index is not None else 0
print(json.dumps({"name": torch.cuda.get_device_name(index) if cuda else dev.type,
                  "device": str(dev),
                  "capability": list(torch.cuda.get_device_capability(index)) if cuda else None,
                  "torch": torch.__version__, "cuda": torch.version.cuda, "triton": tri}))
PYEOF
cat "$OUT_DIR/device.json"

START=$SECONDS
# phase NAME SECONDS OUTFILE COMMAND...: stdout to OUTFILE, stderr to NAME.err, limited to the
# smaller of SECONDS x LIMIT_SCALE and what is left of TOTAL_LIMIT (a phase with no time left
# is skipped).
phase() {
    local name=$1 limit=$(($2 * LIMIT_SCALE)) out=$3
    shift 3
    local left=$((TOTAL_LIMIT - (SECONDS - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 0 ]; then
        echo "== $name: skipped, the run's limit of ${TOTAL_LIMIT}s is spent"
        return 124
    fi
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out" 2> "$OUT_DIR/$name.err"
    local rc=$?
    if [ $rc -eq 124 ]; then
        echo "== $name: stopped after its limit of ${limit}s (see $OUT_DIR/$name.err)"
    elif [ $rc -ne 0 ]; then
        echo "== $name: failed with exit $rc (see $OUT_DIR/$name.err)"
    else
        echo "== $name: done in $((SECONDS - t0))s"
    fi
    return $rc
}

if [ -n "$SMOKE" ]; then  # tiny shapes, one repeat, compiled rows traced without inductor
    table_presets=(--table-preset tiny-switchhead) table_batch=1
    sizes=(47m) att=(tiny-dense tiny-switchhead) batch=1 REPEATS=1
    ff=(--tokens 64 --d-model 16 --experts 4 --expert-size 8 --no-hf)
    em=(-M 64 -D 16 -E 4 -K 2 -F 8) impls=(auto concat padded) warm=(--warmup 0)
    suite_args=(tests/ops/test_concat_kernel.py -k "form_follows or needs_no_plan")
    export MOEIFY_COMPILE_BACKEND=eager
else
    table_presets=() table_batch=$BATCH sizes=(47m 262m) ff=() batch=$BATCH warm=()
    # The 47M SwitchHead value experts: [memory ; x] rows, 2 heads x 5 experts, 4 picks, F 76.
    em=(-M 32768 -D 412 -E 10 -K 4 -F 76 --groups 2)
    # Every kernel a training step can take ("grouped" cannot run at these widths: rows of
    # 412 or 132 bf16 are not 16-byte multiples; "gather" copies [M*K, D, F] weights).
    impls=(auto triton concat concat_saved padded segment sets)
    suite_args=(-m cuda tests/train/test_cuda.py)
fi
common=(--device "$DEVICE" --dtype bfloat16 --json)

# a: the kernels (autotuning timed), the device table, the unpadded Triton kernels, a profile.
MOEIFY_TRITON_AUTOTUNE=1 phase expert-matmul 110 "$OUT_DIR/expert-matmul.json" \
    "${MOEIFY[@]}" bench expert-matmul --preset-shapes "${table_presets[@]}" \
    --batch "$table_batch" --write-table "$OUT_DIR/kernel-table.json" --repeats "$REPEATS" \
    "${common[@]}"
if [ -n "$cuda" ]; then  # what the width padding (16-byte aligned rows) buys
    MOEIFY_TRITON_PAD=0 phase expert-matmul-unpadded 15 "$OUT_DIR/expert-matmul-unpadded.json" \
        "${MOEIFY[@]}" bench expert-matmul "${em[@]}" --impl triton --repeats "$REPEATS" \
        "${common[@]}"
fi
prof_impls=(--impl triton --impl concat --impl concat_saved --impl padded)
[ -n "$cuda" ] || prof_impls=(--impl concat --impl padded)
phase expert-matmul-profile 15 "$OUT_DIR/expert-matmul-profile.json" \
    "${MOEIFY[@]}" bench expert-matmul "${em[@]}" "${prof_impls[@]}" --repeats 1 --profile \
    "${common[@]}"

# b: attention layers, each kernel forced and auto.
forced=()
for i in "${impls[@]}"; do forced+=(--expert-impl "$i"); done
for size in "${sizes[@]}"; do
    [ -n "$SMOKE" ] || att=("wt103-$size-dense" "wt103-$size-switchhead")
    presets=()
    for p in "${att[@]}"; do presets+=(--preset "$p"); done
    phase "attention-$size" 30 "$OUT_DIR/attention-$size.json" \
        "${MOEIFY[@]}" bench attention "${presets[@]}" "${forced[@]}" --no-textbook \
        --no-memory --batch "$batch" --repeats "$REPEATS" "${warm[@]}" "${common[@]}"
done

# c: training steps, eager, compiled and CUDA graphs.
for size in "${sizes[@]}"; do
    [ -n "$SMOKE" ] || att=("wt103-$size-dense" "wt103-$size-switchhead")
    presets=()
    for p in "${att[@]}"; do presets+=(--preset "$p"); done
    mem=(--no-compiled-memory)
    [ -n "$SMOKE" ] && mem=(--no-memory)
    phase "step-$size" 75 "$OUT_DIR/step-$size.json" \
        "${MOEIFY[@]}" bench step "${presets[@]}" --batch "$batch" --repeats "$REPEATS" \
        --compile "${mem[@]}" "${warm[@]}" "${common[@]}"
done

# d: feedforward MoEs against Hugging Face's Mixtral experts.
phase ff 25 "$OUT_DIR/ff.json" "${MOEIFY[@]}" bench ff "${ff[@]}" --repeats "$REPEATS" \
    "${warm[@]}" "${common[@]}"

# e: the test suite on the device, then the Triton kernels on it.
suite=0
if [ -z "${SKIP_SUITE:-}" ]; then
    MOEIFY_SUITE_DEVICE=$DEVICE phase suite 60 "$OUT_DIR/suite.txt" \
        "$PY" -m pytest "${suite_args[@]}" -p no:cacheprovider -rfs
    suite=$?
    tail -n 5 "$OUT_DIR/suite.txt"
    if [ -n "$cuda" ] && "$PY" -c "import triton" 2>/dev/null; then
        MOEIFY_SUITE_DEVICE=$DEVICE phase triton-tests 25 "$OUT_DIR/triton-tests.txt" \
            "$PY" -m pytest tests/ops/test_triton_matmul.py -p no:cacheprovider -rfs || suite=1
        tail -n 3 "$OUT_DIR/triton-tests.txt"
    fi
fi

# f: the SwitchHead authors' kernel, in a phase of its own (a peer that fails loses nothing).
if [ -n "${CVMM:-}" ]; then
    phase expert-matmul-peer 20 "$OUT_DIR/expert-matmul-peer.json" \
        "${MOEIFY[@]}" bench expert-matmul -M 32768 -D 412 -E 10 -K 4 -F 76 --impl triton \
        --impl concat --peer "cvmm=$CVMM" --repeats "$REPEATS" "${common[@]}"
fi

echo "== total: $((SECONDS - START))s of ${TOTAL_LIMIT}s"
"$PY" scripts/gpu_summary.py "$OUT_DIR"
exit "$suite"
