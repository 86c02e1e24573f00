"""Process-level settings moeify's commands run under (the CLI re-executes itself with them; the
compare/sweep scheduler starts its child runs with them)."""

# glibc malloc settings the CLI runs under (CPU analogue of PyTorch's CUDA caching allocator):
# keep freed memory instead of returning every large buffer to the OS. Without them each step
# page-faults its fresh activation and gradient buffers, which on CPU costs as much as the
# matmuls (moeify bench expert-matmul: dense 54-61 ms -> 44 ms at the default shapes).
# Opt out with MOEIFY_NO_MALLOC_TUNING=1.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 32),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
    "MALLOC_TOP_PAD_": str(512 << 20),
}
