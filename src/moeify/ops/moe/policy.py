"""The policy: which kernel "auto" runs, decided in this one place for every layer (SwitchHead,
MoA, sigma-MoE, Switch, the expert MLP), decoding included.

From the device, the dtype, the shapes and the routing in the plan (its grouping and
balance):

CUDA: "triton" (fused kernels) where triton imports and the dtype is float32, float16 or
bfloat16, else "grouped" for bfloat16 on Hopper+ (torch's grouped GEMM), else "segment".

CPU: moeify.ops.moe.cpu.policy (the decoding layouts, "sets", "padded" or "segment", with the
thresholds measured for them).

torch.compile: the call is the registered op ``moeify::expert_matmul``; ``compiled_impl`` names
its kernel when tracing (a slot-layout kernel named by the caller, CUDA's choice, or "auto"),
and inside the op "auto" is ``choose_impl(..., layouts_only=True)`` at run time, so the
compiled graph keeps a sparse layout.
"""

from __future__ import annotations

import torch

from moeify.ops.moe.kernels.grouped import HAS_GROUPED_MM, grouped_ok
from moeify.ops.moe.cpu.policy import cpu_choice
from moeify.ops.moe.kernels.scatter_gemm import DTYPES as TRITON_DTYPES
from moeify.ops.moe.kernels.scatter_gemm import triton_available
from moeify.ops.moe.plan import RoutingPlan, make_plan
from moeify.ops.moe.registry import ExpertKernel, WholeKernel, get_kernel


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
    return cpu_choice(x_MD, w_EDF, plan, k=k, gated=gated, layouts_only=layouts_only)


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


__all__ = ["choose_impl", "compiled_impl", "planless", "resolve_name", "resolved_impl",
           "triton_ok"]
