"""The policy: which kernel "auto" runs, decided in this one place for every layer (SwitchHead,
MoA, sigma-MoE, Switch, the expert MLP), decoding included.

From the device, the dtype, the shapes and the routing in the plan (its grouping and
balance):

CUDA: "triton" (fused kernels) where triton imports and the dtype is float32, float16 or
bfloat16, else "grouped" for bfloat16 on Hopper+ (torch's grouped GEMM), else "segment".

CPU, where grouped_mm and the per-expert loop call the same GEMM: "pairs" for a handful of
pairs and "all" for a handful of rows (decoding, where reading the weights is the cost:
``few_rows_impl``), then "sets" where the plan's expert groups make it pay
(``sets_eligible``), "segment" where the average expert's GEMM is large (``SEGMENT_MIN_MACS``),
else "padded" where ``padding_pays`` (one parallel region instead of one per expert), else
"segment".

torch.compile: the call is the registered op ``moeify::expert_matmul``; ``compiled_impl`` names
its kernel when tracing (a slot-layout kernel named by the caller, CUDA's choice, or "auto"),
and inside the op "auto" is ``choose_impl(..., layouts_only=True)`` at run time, so the
compiled graph keeps a sparse layout.

The thresholds and the measurements behind them: docs/benchmarks/expert-matmul-cpu-policy.md.
"""

from __future__ import annotations

import torch

from moeify.ops.moe.kernels.grouped import HAS_GROUPED_MM, grouped_ok
from moeify.ops.moe.kernels.triton import DTYPES as TRITON_DTYPES
from moeify.ops.moe.kernels.triton import triton_available
from moeify.ops.moe.plan import RoutingPlan, make_plan
from moeify.ops.moe.registry import ExpertKernel, WholeKernel, get_kernel
from moeify.ops.moe.switchhead import sets_eligible

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


def planless(impl: str) -> bool:
    """Whether ``impl`` runs without a routing plan (the callers skip building one)."""
    kernel = get_kernel(impl) if impl != "auto" else None
    return isinstance(kernel, WholeKernel) and not kernel.needs_plan


def resolve_name(impl: str, x: torch.Tensor, w: torch.Tensor) -> str:
    """Check the name; "grouped" falls back to "segment" where grouped_mm cannot run."""
    if impl == "auto":
        return impl
    kernel = get_kernel(impl)
    if impl == "grouped" and kernel.unavailable(x, w) is not None:
        return "segment"
    if impl == "triton":
        reason = kernel.unavailable(x, w)
        if reason is not None:
            raise ValueError(reason)
    return impl


def choose_impl(impl: str, x_MD: torch.Tensor, w_EDF: torch.Tensor,
                plan: RoutingPlan | None = None, *, k: int = 1, gated: bool = True,
                layouts_only: bool = False) -> str:
    """The kernel an expert matmul runs (module docstring). ``k``: experts per output unit
    (K / G); ``gated``: whether the call has gates; ``layouts_only``: choose among the
    slot-layout kernels only (inside the registered op). A concrete name passes through."""
    name = resolve_name(impl, x_MD, w_EDF)
    if name != "auto":
        return name
    if x_MD.device.type == "cuda":
        if triton_ok(x_MD):
            return "triton"
        fast = (x_MD.dtype == torch.bfloat16
                and torch.cuda.get_device_capability(x_MD.device)[0] >= 9)
        return "grouped" if fast and HAS_GROUPED_MM and grouped_ok(x_MD, w_EDF) else "segment"
    if x_MD.device.type != "cpu" or plan is None:
        return "segment"
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


def triton_ok(x: torch.Tensor) -> bool:
    """Whether "auto" takes the fused Triton kernels: CUDA, a kernel dtype, triton importable."""
    return x.device.type == "cuda" and x.dtype in TRITON_DTYPES and triton_available()


def compiled_impl(impl: str, x: torch.Tensor, w: torch.Tensor) -> str:
    """The kernel a compiled graph's registered op runs: a slot-layout kernel (the graph's
    sparse layout), decided from what tracing knows. ``impl`` itself when it is one; on CUDA
    the device and dtype decide "auto" (no routing is needed for it); else "auto", which the
    op resolves at run time among the slot-layout kernels from the routing
    (``choose_impl(..., layouts_only=True)``). Kernels that run the whole contract themselves
    (the dense ones, "sets") give way to "auto"."""
    if impl != "auto" and isinstance(get_kernel(impl), ExpertKernel):
        return resolve_name(impl, x, w)
    if x.device.type == "cuda":
        return choose_impl("auto", x, w)
    return "auto"


def resolved_impl(impl: str, x_MD: torch.Tensor, idx_MK: torch.Tensor, w_EDF: torch.Tensor,
                  *, group_size: int | None = None, gated: bool = True, groups: int = 1) -> str:
    """The kernel ``expert_matmul(x_MD, idx_MK, w_EDF, gates, groups=groups, impl=impl,
    plan=make_plan(idx_MK, E, group_size=group_size))`` runs, eagerly (``choose_impl``)."""
    plan = make_plan(idx_MK, w_EDF.shape[0], group_size=group_size)
    return choose_impl(impl, x_MD, w_EDF, plan, k=idx_MK.shape[1] // groups, gated=gated)


__all__ = ["ALL_MAX_MACS", "ALL_MAX_ROWS", "PAIRS_MAX", "SEGMENT_MIN_MACS", "SINGLE_THREAD_SLACK",
           "choose_impl", "compiled_impl", "decodes_all", "few_rows_impl", "padding_pays",
           "planless", "resolve_name", "resolved_impl", "triton_ok"]
