#!/usr/bin/env bash
# The GPU check: the CUDA test suite, then the paper's Table 5 measurements in bf16 on this GPU:
# one attention layer (`moeify bench attention`) and a whole training step (`moeify bench step`)
# of the WT103 47M and 262M presets, SwitchHead against its dense baseline, with time and memory
# ratios to dense printed beside the paper's (47M: 0.72x time, 0.65x memory on an RTX 3090;
# 262M: 0.65x, 0.61x on 8 V100s).
#
# Also the Triton expert-matmul kernel tests on the GPU (where triton imports) and the
# expert-matmul implementations (triton among them) at the 47M SwitchHead value shape.
#
#   scripts/gpu_check.sh                 everything (about 10 minutes on one H100/H200)
#   SKIP_SUITE=1 scripts/gpu_check.sh    benchmarks only
#   BATCH=32 COMPILE=1 ...               step batch (default 64, the paper's), compiled rows too
#
# JSON results and logs go to $OUT_DIR (default gpu-check/). Exit status: the suite's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MOEIFY=${MOEIFY:-.venv/bin/moeify}
OUT_DIR=${OUT_DIR:-gpu-check}
BATCH=${BATCH:-64}
mkdir -p "$OUT_DIR"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $PY; nothing to check" >&2
    exit 2
fi
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)" | tee "$OUT_DIR/device.txt"

suite=0
if [ -z "${SKIP_SUITE:-}" ]; then
    echo "== pytest -m cuda"
    timeout 900 "$PY" -m pytest -m cuda tests/train/test_cuda.py -q -p no:cacheprovider 2>&1 \
        | tee "$OUT_DIR/suite.txt"
    suite=${PIPESTATUS[0]}
fi

if [ -z "${SKIP_SUITE:-}" ] && "$PY" -c "import triton" 2>/dev/null; then
    echo "== triton expert-matmul kernels on the GPU (tests/ops/test_triton_matmul.py, bf16 too)"
    timeout 600 "$PY" -m pytest tests/ops/test_triton_matmul.py -q -p no:cacheprovider 2>&1 \
        | tee "$OUT_DIR/triton-tests.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || suite=1
fi
echo "== bench expert-matmul at the 47M SwitchHead value shape (bf16)"
timeout 600 "$MOEIFY" bench expert-matmul --device cuda --dtype bfloat16 -M 32768 -D 412 -E 10 \
    -K 4 -F 76 --json > "$OUT_DIR/expert-matmul-47m.json" 2> "$OUT_DIR/expert-matmul-47m.err" \
    || echo "bench expert-matmul failed: see $OUT_DIR/expert-matmul-47m.err"

compile_flag=()
[ -n "${COMPILE:-}" ] && compile_flag=(--compile)
for size in 47m 262m; do
    presets=(--preset "wt103-$size-dense" --preset "wt103-$size-switchhead")
    echo "== bench attention $size (bf16)"
    timeout 900 "$MOEIFY" bench attention --device cuda --dtype bfloat16 "${presets[@]}" \
        --no-textbook --json > "$OUT_DIR/attention-$size.json" 2> "$OUT_DIR/attention-$size.err" \
        || echo "bench attention $size failed: see $OUT_DIR/attention-$size.err"
    echo "== bench step $size (bf16, batch $BATCH)"
    timeout 900 "$MOEIFY" bench step --device cuda --dtype bfloat16 --batch "$BATCH" \
        "${presets[@]}" "${compile_flag[@]}" --json > "$OUT_DIR/step-$size.json" \
        2> "$OUT_DIR/step-$size.err" || echo "bench step $size failed: see $OUT_DIR/step-$size.err"
done

"$PY" - "$OUT_DIR" <<'PYEOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
paper = {"47m": (0.72, 0.65), "262m": (0.65, 0.61)}  # switchhead.md §7, Table 5
print("\nratios to dense (bf16 on GPU); paper Table 5 = whole training step")
print(f"{'bench':<10} {'size':<5} {'case':<34} {'time x':>7} {'memory x':>9}  paper (time, memory)")
for size in ("47m", "262m"):
    for kind in ("attention", "step"):
        f = out / f"{kind}-{size}.json"
        try:
            res = json.loads(f.read_text())
        except (OSError, ValueError):
            print(f"{kind:<10} {size:<5} (no result: {f})")
            continue
        rows = res["rows"] if kind == "step" else [r for g in res["groups"] for r in g["rows"]]
        for r in rows:
            t = r.get("time x", r.get("fwd+bwd x"))
            m = r.get("peak x")
            ref = paper[size] if kind == "step" and "switchhead" in r["case"] else ""
            fmt = lambda v: "-" if v is None else f"{v:.3f}"
            print(f"{kind:<10} {size:<5} {r['case']:<34} {fmt(t):>7} {fmt(m):>9}  {ref}")
PYEOF
exit "$suite"
