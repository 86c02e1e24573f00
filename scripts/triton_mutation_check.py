"""Break the Triton expert-matmul kernels on purpose, one index at a time, and check that
tests/ops/test_triton_matmul.py fails for every break (and passes unbroken).

    python scripts/triton_mutation_check.py        # a few minutes in the CPU interpreter

Each mutation edits src/moeify/ops/moe/kernels/_triton_jit.py in place, runs the test file in a fresh
process (TRITON_INTERPRET=1 where there is no CUDA) and restores the file, also on an error or
Ctrl-C. Exit status 0 when every mutation was caught.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "src" / "moeify" / "ops" / "moe" / "kernels" / "_triton_jit.py"

# (what is broken, the exact source text, its broken replacement)
MUTATIONS = [
    ("forward reads row p instead of p // K",
     "    m = p // K  # their input rows", "    m = p  # their input rows"),
    ("forward writes to the sorted position",
     "    offs = p[:, None] * F + f[None, :]  # [N, F], contiguous",
     "    offs = r[:, None].to(tl.int64) * F + f[None, :]"),
    ("input gradient reads the sorted position",
     "        gr = tl.load(grad_ptr + p[:, None] * F + f[None, :],\n"
     "                     mask=rmask[:, None] & fmask[None, :], other=0.0)\n        wt",
     "        gr = tl.load(grad_ptr + r[:, None].to(tl.int64) * F + f[None, :],\n"
     "                     mask=rmask[:, None] & fmask[None, :], other=0.0)\n        wt"),
    ("input gradient stores where it must add",
     "        tl.atomic_add(gx_ptr + offs, acc, mask=xmask, sem=\"relaxed\")",
     "        tl.store(gx_ptr + offs, acc, mask=xmask)"),
    ("weight gradient reads row p % K",
     "        m = p // K\n        xt =", "        m = p % K\n        xt ="),
    ("tile search off by one expert",
     "    e = tl.sum((cum <= pid).to(tl.int32), 0)", "    e = tl.sum((cum < pid).to(tl.int32), 0)"),
    ("tile runs past its expert's end",
     "    end = tl.where(valid, end, start)", "    end = tl.where(valid, end + 1, start)"),
]


def run_tests() -> bool:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    res = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                          str(REPO / "tests" / "ops" / "test_triton_matmul.py"),
                          "--deselect", "tests/ops/test_triton_matmul.py::"
                          "test_every_kernel_compiles_for_hopper"],
                         cwd=REPO, env=env, capture_output=True, text=True)
    return res.returncode == 0


def main() -> int:
    original = KERNELS.read_text()
    missed = 0
    try:
        if not run_tests():
            print("the unbroken kernels fail the tests: fix that first")
            return 2
        print("unbroken: tests pass")
        for name, old, new in MUTATIONS:
            if original.count(old) != 1:
                print(f"SKIPPED (source text not found once): {name}")
                missed += 1
                continue
            KERNELS.write_text(original.replace(old, new))
            caught = not run_tests()
            missed += not caught
            print(f"{'caught' if caught else 'MISSED'}: {name}")
    finally:
        KERNELS.write_text(original)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
