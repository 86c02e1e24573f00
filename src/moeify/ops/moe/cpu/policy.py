"""What "auto" runs on the CPU, where grouped_mm and the per-expert loop call the same GEMM
(the shared policy, moeify.ops.moe.policy, hands CPU calls here):

"pairs" for a handful of pairs and "all" for a handful of rows (decoding, where reading the
weights is the cost: ``few_rows_impl``), then "sets" where the plan's expert groups make it pay
(``sets_eligible``), "segment" where the average expert's GEMM is large (``SEGMENT_MIN_MACS``),
else "padded" where ``padding_pays`` (one parallel region instead of one per expert), else
"segment".

The thresholds and the measurements behind them: docs/benchmarks/expert-matmul-cpu-policy.md.
"""

from __future__ import annotations

import torch

from moeify.ops.moe.cpu.sets import sets_eligible
from moeify.ops.moe.plan import RoutingPlan

# Decoding on CPU: "pairs" for at most as many pairs as there are experts (and PAIRS_MAX), else
# "all" for at most ALL_MAX_ROWS rows while that costs at most ALL_MAX_MACS multiply-adds
# (rows x E x D x F).
PAIRS_MAX = 16
ALL_MAX_ROWS = 32
ALL_MAX_MACS = 1 << 26
# One GEMM per expert (no padding) once the average expert's GEMM has this many multiply-adds:
# a parallel region's start-up is then negligible and padding is pure waste.
SEGMENT_MIN_MACS = 1 << 26
# Single-threaded there is no thread wake-up to save: pad only when it is nearly free.
SINGLE_THREAD_SLACK = 1.1


def cpu_choice(x_MD: torch.Tensor, w_EDF: torch.Tensor, plan: RoutingPlan, *, k: int = 1,
               gated: bool = True, layouts_only: bool = False) -> str:
    """The kernel "auto" runs on CPU tensors (module docstring); ``layouts_only``: among the
    slot-layout kernels only (inside the registered op)."""
    if not layouts_only:
        few = few_rows_impl(x_MD, w_EDF, plan.num_pairs)
        if few is not None:
            return few
        if gated and sets_eligible(plan.num_pairs // k, plan.group_size,
                                   plan.num_experts // (plan.group_size or 1), k):
            return "sets"
    per_expert = plan.num_pairs // plan.num_experts * x_MD.shape[1] * w_EDF.shape[-1]
    if per_expert >= SEGMENT_MIN_MACS:
        return "segment"
    return "padded" if padding_pays(plan) else "segment"


def padding_pays(plan: RoutingPlan) -> bool:
    """Whether the padded layout beats the per-expert loop for this routing on CPU: always
    with several threads (one parallel region instead of E), single-threaded only when the
    padding is nearly free."""
    N = plan.num_pairs
    if N == 0:
        return False
    if torch.get_num_threads() > 1:
        return True
    return plan.num_experts * plan.max_count() <= SINGLE_THREAD_SLACK * N


def few_rows_impl(x_MD: torch.Tensor, w_EDF: torch.Tensor, num_pairs: int) -> str | None:
    """What "auto" takes on CPU for a handful of rows, decided from the shapes before any
    routing exists: "pairs" for at most as many pairs as there are experts, "all" for a few
    rows, else None (a sorted layout, chosen from the plan)."""
    E = w_EDF.shape[0]
    if num_pairs <= min(E, PAIRS_MAX):
        return "pairs"
    M = x_MD.shape[0]
    if M <= ALL_MAX_ROWS and M * E * w_EDF.shape[1] * w_EDF.shape[2] <= ALL_MAX_MACS:
        return "all"
    return None


def decodes_all(impl: str, x_MD: torch.Tensor, w_EDF: torch.Tensor, num_pairs: int) -> bool:
    """Whether a layer may run expert projection ``w_EDF`` for every expert itself, fused with
    its other projections (SwitchHead's decoding step): where "auto" would take the "all"
    layout anyway (CPU, a few rows), no gradient flows to the weights (the layer keeps fused
    copies of them between calls) and nothing is being compiled."""
    if impl != "auto" or x_MD.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled() and w_EDF.requires_grad or w_EDF.is_inference():
        return False  # inference tensors have no version counter to key the fused copies on
    return few_rows_impl(x_MD, w_EDF, num_pairs) == "all"


__all__ = ["ALL_MAX_MACS", "ALL_MAX_ROWS", "PAIRS_MAX", "SEGMENT_MIN_MACS", "SINGLE_THREAD_SLACK",
           "cpu_choice", "decodes_all", "few_rows_impl", "padding_pays"]
