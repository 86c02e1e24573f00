"""The built-in expert kernels that every device runs, one module each, registered on import
(moeify.ops.moe.registry): reference and gather (dense.py), segment, grouped, the
dense-over-experts kernels "concat" and "concat_saved" (concat.py) and the fused Triton kernel
"triton" (scatter_gemm.py, imported by moeify.ops.moe). The CPU-only layouts ("pairs", "all",
"padded", "sets") live in moeify.ops.moe.cpu."""

# In this order: the registry lists kernels as registered.
from moeify.ops.moe.kernels import dense  # noqa: F401, I001
from moeify.ops.moe.kernels import segment  # noqa: F401
from moeify.ops.moe.kernels import grouped  # noqa: F401
from moeify.ops.moe.kernels import concat  # noqa: F401
