"""The CPU-only layouts and the thresholds that choose them: where torch's grouped GEMM and the
per-expert loop call the same GEMM, so what pays is fewer parallel regions and wider matmuls.

    padded.py    every expert's rows in one batched matmul ("padded")
    sets.py      SwitchHead's units sorted by expert set ("sets"), the head-major layout
    decoding.py  "pairs" and "all" for a handful of rows, SwitchHead's fused decoding sums
    policy.py    what "auto" takes on the CPU, and the measured thresholds

They run on any device (the tests run every kernel everywhere), but only the CPU policy
chooses them. The shared seam (plan, registry, function, combine, compiled, the kernels that
CUDA takes) lives one level up, in moeify.ops.moe.
"""

# In this order: the registry lists kernels as registered.
from moeify.ops.moe.cpu import decoding  # noqa: F401, I001
from moeify.ops.moe.cpu import padded  # noqa: F401
from moeify.ops.moe.cpu import sets  # noqa: F401
