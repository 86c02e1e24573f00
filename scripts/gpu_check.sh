#!/usr/bin/env bash
# The GPU check, one command: the CUDA test suite, then the benchmarks in bf16 on this GPU, each
# phase under its own time limit, then one JSON and one markdown table of every ratio beside the
# paper's (SwitchHead Table 5: 47M 0.72x time, 0.65x memory; 262M 0.65x, 0.61x) and moeify's
# targets (scripts/gpu_summary.py). The expert-matmul bench runs at the 47M SwitchHead value shape
# (every implementation, the Triton kernels among them), then one profiled call of the fastest
# ones (their kernels, launches and time shares); the Triton kernel tests run on the device when
# triton imports.
#
#   scripts/gpu_check.sh                        everything (about 6 minutes on one H100/H200)
#   SKIP_SUITE=1 scripts/gpu_check.sh           benchmarks only
#   BATCH=32 REPEATS=5 COMPILE=1 ...            step batch (default 64, the paper's), repeats
#                                               (default 3), compiled step rows too
#   DEVICE=cpu SMALL=1 SKIP_SUITE=1 ...         the script itself on a CPU, at tiny shapes
#   CVMM=moeut/moeut/cvmm.py ...                the SwitchHead authors' kernel beside moeify's
#                                               (their file, from github.com/RobertCsordas/moeut)
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
OUT_DIR=${OUT_DIR:-gpu-check}
DEVICE=${DEVICE:-cuda}
BATCH=${BATCH:-64}
REPEATS=${REPEATS:-3}
mkdir -p "$OUT_DIR"
MOEIFY=("$PY" -m moeify.cli.main)

if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $PY; nothing to check (DEVICE=cpu checks the script)" >&2
    exit 2
fi
"$PY" - "$DEVICE" > "$OUT_DIR/device.json" <<'PYEOF'
import json, sys, torch
dev = sys.argv[1]
try:
    import triton
    tri = triton.__version__
except ImportError:
    tri = None
cuda = dev == "cuda"
print(json.dumps({"name": torch.cuda.get_device_name(0) if cuda else "cpu",
                  "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
                  "torch": torch.__version__, "cuda": torch.version.cuda, "triton": tri}))
PYEOF
cat "$OUT_DIR/device.json"

# phase NAME SECONDS OUTFILE COMMAND...: stdout to OUTFILE, stderr to NAME.err, limited in time.
phase() {
    local name=$1 limit=$2 out=$3
    shift 3
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

suite=0
if [ -z "${SKIP_SUITE:-}" ]; then
    echo "== pytest -m cuda (limit ${SUITE_LIMIT:-300}s)"
    MOEIFY_SUITE_DEVICE=$DEVICE phase suite "${SUITE_LIMIT:-300}" "$OUT_DIR/suite.txt" \
        "$PY" -m pytest -m cuda tests/train/test_cuda.py -q -p no:cacheprovider -rfs
    suite=$?
    tail -n 15 "$OUT_DIR/suite.txt"
    if "$PY" -c "import triton" 2>/dev/null; then  # the kernels on the device, bf16 included
        echo "== Triton expert-matmul kernel tests (limit ${TRITON_LIMIT:-180}s)"
        MOEIFY_SUITE_DEVICE=$DEVICE phase triton-tests "${TRITON_LIMIT:-180}" \
            "$OUT_DIR/triton-tests.txt" "$PY" -m pytest tests/ops/test_triton_matmul.py -q \
            -p no:cacheprovider -rfs || suite=1
        tail -n 5 "$OUT_DIR/triton-tests.txt"
    fi
fi

if [ -n "${SMALL:-}" ]; then  # the script's own check at tiny shapes
    em=(-M 512 -D 40 -E 4 -K 2 -F 24) step=(tiny-dense tiny-switchhead) att=("${step[@]}")
    sizes=(47m) ff=(--tokens 256 --d-model 32 --experts 4 --expert-size 16 --no-hf)
    batch=2
else  # the 47M SwitchHead value experts: [memory ; x] rows, 2 heads x 5 experts, 4 picks, F 76
    em=(-M 32768 -D 412 -E 10 -K 4 -F 76) sizes=(47m 262m) ff=() batch=$BATCH
fi
common=(--device "$DEVICE" --dtype bfloat16 --json)
phase expert-matmul 90 "$OUT_DIR/expert-matmul.json" \
    "${MOEIFY[@]}" bench expert-matmul "${em[@]}" --repeats "$REPEATS" "${common[@]}"
# CVMM=PATH: the SwitchHead authors' cvmm.py timed beside moeify's Triton kernels, in a phase of
# its own (a peer that fails or overruns loses nothing else).
if [ -n "${CVMM:-}" ]; then
    phase expert-matmul-peer 90 "$OUT_DIR/expert-matmul-peer.json" \
        "${MOEIFY[@]}" bench expert-matmul "${em[@]}" --impl triton --peer "cvmm=$CVMM" \
        --repeats "$REPEATS" "${common[@]}"
fi
# The Triton kernels without their width padding (MOEIFY_TRITON_PAD=0), beside the same dense
# GEMM: what the padding (16-byte aligned rows, vectorised loads) buys.
if [ "$DEVICE" = cuda ]; then
    MOEIFY_TRITON_PAD=0 phase expert-matmul-unpadded 60 "$OUT_DIR/expert-matmul-unpadded.json" \
        "${MOEIFY[@]}" bench expert-matmul "${em[@]}" --impl triton --repeats "$REPEATS" \
        "${common[@]}"
fi
# One profiled call of the fastest kernels at the same shape: their launches and where the time
# goes, kernel by kernel (what to tune next).
prof_impls=(--impl triton --impl grouped --impl padded)
[ "$DEVICE" = cuda ] || prof_impls=(--impl segment --impl padded)
phase expert-matmul-profile 90 "$OUT_DIR/expert-matmul-profile.json" \
    "${MOEIFY[@]}" bench expert-matmul "${em[@]}" "${prof_impls[@]}" --repeats 1 --profile \
    "${common[@]}"
compile_flag=()
[ -n "${COMPILE:-}" ] && compile_flag=(--compile)
for size in "${sizes[@]}"; do
    if [ -z "${SMALL:-}" ]; then
        att=("wt103-$size-dense" "wt103-$size-switchhead") step=("${att[@]}")
    fi
    presets=()
    for p in "${att[@]}"; do presets+=(--preset "$p"); done
    phase "attention-$size" 120 "$OUT_DIR/attention-$size.json" \
        "${MOEIFY[@]}" bench attention "${presets[@]}" --no-textbook --repeats "$REPEATS" "${common[@]}"
    phase "step-$size" 180 "$OUT_DIR/step-$size.json" \
        "${MOEIFY[@]}" bench step "${presets[@]}" --batch "$batch" --repeats "$REPEATS" \
        "${compile_flag[@]}" "${common[@]}"
done
phase ff 120 "$OUT_DIR/ff.json" "${MOEIFY[@]}" bench ff "${ff[@]}" --repeats "$REPEATS" "${common[@]}"

"$PY" scripts/gpu_summary.py "$OUT_DIR"
exit "$suite"
