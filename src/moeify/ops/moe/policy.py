"""The policy: which kernel "auto" runs, decided in this one place for every layer (SwitchHead,
MoA, sigma-MoE, Switch, the expert MLP), decoding included.

From the device, the dtype, the shapes and the routing in the plan (its grouping and
balance):

CUDA: the measured table of the device class (moeify.ops.moe.device_table: H100, H200), where
it has an entry within reach of the call's shape; else the fallback rule: "triton" (fused
kernels) where triton imports and the dtype is float32, float16 or bfloat16, else "grouped" for
bfloat16 on Hopper+ (torch's grouped GEMM), else "segment".

CPU: moeify.ops.moe.cpu.policy (the decoding layouts, "sets", "padded" or "segment", with the
thresholds measured for them).

``MOEIFY_KERNEL_TABLE=PATH``: that table decides first on every device (a table measured on
your own machine, CPU included), the rules above where it has no entry within reach.

torch.compile: the call is the registered op ``moeify::expert_matmul``; ``compiled_impl`` names
its kernel when tracing (a slot-layout kernel named by the caller, CUDA's choice, or "auto"),
and inside the op "auto" is ``choose_impl(..., layouts_only=True)`` at run time, so the
compiled graph keeps a sparse layout. A traceable kernel ("concat") is traced in place instead.

A kernel named explicitly runs or raises a ValueError saying why it cannot run here (never a
silent substitute).
"""

from __future__ import annotations

import torch

from moeify.ops.moe.cpu.policy import cpu_choice
from moeify.ops.moe.device_table import device_ranking
from moeify.ops.moe.kernels.grouped import HAS_GROUPED_MM, grouped_ok
from moeify.ops.moe.kernels.scatter_gemm import DTYPES as TRITON_DTYPES
from moeify.ops.moe.kernels.scatter_gemm import triton_available
from moeify.ops.moe.plan import RoutingPlan, make_plan
from moeify.ops.moe.registry import ExpertKernel, WholeKernel, get_kernel


def planless(impl: str) -> bool:
    """Whether ``impl`` runs without a routing plan (the callers skip building one)."""
    kernel = get_kernel(impl) if impl != "auto" else None
    return isinstance(kernel, WholeKernel) and not kernel.needs_plan


def resolve_name(impl: str, x: torch.Tensor, w: torch.Tensor) -> str:
    """Check the name: a registered kernel that can run on these operands, or "auto"; a kernel
    that cannot run here raises ValueError with its reason (no silent substitute)."""
    if impl == "auto":
        return impl
    reason = get_kernel(impl).unavailable(x, w)
    if reason is not None:
        raise ValueError(reason)
    return impl


def choose_impl(impl: str, x_MD: torch.Tensor, w_EDF: torch.Tensor,
                plan: RoutingPlan | None = None, *, k: int = 1, gated: bool = True,
                layouts_only: bool = False, compiled: bool = False,
                n_pairs: int | None = None) -> str:
    """The kernel an expert matmul runs (module docstring). ``k``: experts per output unit
    (K / G); ``gated``: whether the call has gates; ``layouts_only``: choose among the
    slot-layout kernels only (inside the registered op); ``compiled``: among the kernels a
    compiled graph runs (slot layouts and traceable ones); ``n_pairs``: the routed pairs when
    no plan says (the table's K). A concrete name passes through."""
    name = resolve_name(impl, x_MD, w_EDF)
    if name != "auto":
        return name
    measured = measured_impl(x_MD, w_EDF, plan, gated=gated, layouts_only=layouts_only,
                             compiled=compiled, n_pairs=n_pairs)
    if measured is not None:
        return measured
    if x_MD.device.type == "cuda":
        if triton_ok(x_MD):
            return "triton"
        fast = (x_MD.dtype == torch.bfloat16
                and torch.cuda.get_device_capability(x_MD.device)[0] >= 9)
        return "grouped" if fast and HAS_GROUPED_MM and grouped_ok(x_MD, w_EDF) else "segment"
    if x_MD.device.type != "cpu" or plan is None:
        return "segment"
    return cpu_choice(x_MD, w_EDF, plan, k=k, gated=gated, layouts_only=layouts_only)


def measured_impl(x_MD: torch.Tensor, w_EDF: torch.Tensor, plan: RoutingPlan | None, *,
                  gated: bool, layouts_only: bool = False, compiled: bool = False,
                  n_pairs: int | None = None) -> str | None:
    """The measured table's choice for this call (moeify.ops.moe.device_table), or None: no
    table for the device, no entry within reach, or no measured kernel that may run here."""
    M = int(x_MD.shape[0])
    pairs = plan.num_pairs if plan is not None else n_pairs
    names = device_ranking(str(x_MD.device), str(x_MD.dtype).removeprefix("torch."), gated, M,
                           int(pairs) // M if pairs and M else 1, int(w_EDF.shape[0]),
                           int(x_MD.shape[1]), int(w_EDF.shape[-1]))

    def may_run(name: str) -> bool:
        try:
            kernel = get_kernel(name)
        except ValueError:  # measured, but not registered in this version
            return False
        if kernel.unavailable(x_MD, w_EDF) is not None:
            return False
        if isinstance(kernel, ExpertKernel):
            return True
        if layouts_only or (compiled and not kernel.traceable):
            return False
        return not kernel.needs_plan or (plan is not None and plan.group_size is not None
                                         and gated)

    return next((name for name in names if may_run(name)), None)


def triton_ok(x: torch.Tensor) -> bool:
    """Whether "auto" takes the fused Triton kernels: CUDA, a kernel dtype, triton importable."""
    return x.device.type == "cuda" and x.dtype in TRITON_DTYPES and triton_available()


def compiled_impl(impl: str, x: torch.Tensor, w: torch.Tensor,
                  n_pairs: int | None = None) -> str:
    """The kernel a compiled graph runs, decided from what tracing knows: ``impl`` itself when
    it is a slot-layout kernel (run inside the registered op: the graph's sparse layout) or a
    traceable one (traced in place); on CUDA the device and dtype decide "auto" (no routing is
    needed for it); else "auto", which the op resolves at run time among the slot-layout
    kernels from the routing (``choose_impl(..., layouts_only=True)``). Kernels that run the
    whole contract themselves with host-side work (the reference, "gather", "sets", the
    decoding layouts) give way to "auto". ``n_pairs``: the routed pairs (the table's K)."""
    if impl != "auto":
        kernel = get_kernel(impl)
        if isinstance(kernel, ExpertKernel) or getattr(kernel, "traceable", False):
            return resolve_name(impl, x, w)
    if x.device.type == "cuda":
        return choose_impl("auto", x, w, compiled=True, n_pairs=n_pairs)
    return "auto"


def traced(name: str) -> WholeKernel | None:
    """The kernel ``name`` when torch.compile traces it in place of the registered op."""
    kernel = get_kernel(name) if name != "auto" else None
    return kernel if isinstance(kernel, WholeKernel) and kernel.traceable else None


def resolved_impl(impl: str, x_MD: torch.Tensor, idx_MK: torch.Tensor, w_EDF: torch.Tensor,
                  *, group_size: int | None = None, gated: bool = True, groups: int = 1) -> str:
    """The kernel ``expert_matmul(x_MD, idx_MK, w_EDF, gates, groups=groups, impl=impl,
    plan=make_plan(idx_MK, E, group_size=group_size))`` runs, eagerly (``choose_impl``)."""
    plan = make_plan(idx_MK, w_EDF.shape[0], group_size=group_size)
    return choose_impl(impl, x_MD, w_EDF, plan, k=idx_MK.shape[1] // groups, gated=gated)


__all__ = ["choose_impl", "compiled_impl", "measured_impl", "planless", "resolve_name",
           "resolved_impl", "traced", "triton_ok"]
