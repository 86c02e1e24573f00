"""The expert matmul: every row times the weight matrices of the experts it was routed to.

This is the one primitive every Mixture-of-Experts layer in moeify shares (SwitchHead's value,
output, query and key experts, MoA's query/output experts, sigma-MoE and Switch feedforwards).
The SwitchHead authors call it CVMM; MegaBlocks and torchtitan call it grouped GEMM.

Shape legend
    M  rows                  K  experts per row            E  experts
    D  input width           F  output width               N  = M * K routed (row, expert) pairs
    G  output groups (gate-weighted sums over K in G equal consecutive groups)
    P  slots of a kernel's layout (N, or more with padding)

Given x_MD, idx_MK (ids in [0, E)), w_EDF and optional gates_MK:
    without gates:  y[m, k]    = x[m] @ w[idx[m, k]]                                  -> [M, K, F]
    with gates:     y[m]       = sum_k gates[m, k] * x[m] @ w[idx[m, k]]              -> [M, F]
    with gates and groups=G:   y[m, g] = sum over k in group g of the same            -> [M, G, F]
    with gates and sum_rows=R: y[m] = sum over the R rows m·R + r and all k of the same -> [M/R, F]
                               (SwitchHead's output experts: rows (token, head), one sum per token)

How it runs: the routing is a ``RoutingPlan`` (sorted once, shared by the matmuls that use it);
``impl`` names a registered kernel (moeify.ops.moe.registry), "auto" lets the policy choose
(moeify.ops.moe.policy, the one place where that is decided). A kernel over a slot layout runs
inside ``ExpertMatmulFunction``: the rows gathered into its slots (unless it reads them
itself), its GEMMs, the shared combine (moeify.ops.moe.combine); the backward takes the output
gradient to the slots, the gate gradient on the narrower side, and the kernel's input- and
weight-gradient entry points. Under torch.compile the call is the registered op
``moeify::expert_matmul`` (moeify.ops.moe.compiled), so the graph keeps the sparse layout.

While a profiler records, each call runs inside a range named ``TRACE_PREFIX`` + the kernel,
so that a benchmark can report what really ran (``moeify.bench.timing.expert_impls_run``);
without one no range is opened (it costs about 10 us, a tenth of a decoding step's matmul).
"""

from __future__ import annotations

import contextlib

import torch

from moeify.ops.amp import autocast_cast, autocast_off
from moeify.ops.moe import compiled, policy
from moeify.ops.moe.function import ExpertMatmulFunction
from moeify.ops.moe.plan import RoutingPlan, check_ids, make_plan
from moeify.ops.moe.registry import ExpertKernel, get_kernel

# Profiler range of every expert matmul: TRACE_PREFIX + the kernel that ran.
TRACE_PREFIX = "moeify.expert_matmul."


def trace(impl: str):
    """The profiler range ``TRACE_PREFIX + impl`` while a profiler records, else nothing."""
    if torch.compiler.is_compiling() or not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"{TRACE_PREFIX}{impl}")


# ---------------------------------------------------------------------------------------------


def validate(x, idx, w, gates, groups=1, sum_rows=1, batch=None):
    """Raise ValueError, saying what to change, unless the operands fit the contract."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, D], got shape {tuple(x.shape)}")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise ValueError(f"expert ids must be an integer tensor, got dtype {idx.dtype}")
    if idx.dim() != 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(f"idx must be [M, K] with M = {x.shape[0]} (rows of x), "
                         f"got shape {tuple(idx.shape)}")
    if w.dim() != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be [E, D, F] with D = {x.shape[1]} (width of x), "
                         f"got shape {tuple(w.shape)}")
    if gates is not None and gates.shape != idx.shape:
        raise ValueError(f"gates must have the shape of idx {tuple(idx.shape)}, "
                         f"got {tuple(gates.shape)}")
    if groups < 1 or idx.shape[1] % groups:
        raise ValueError(f"groups={groups} must be a positive divisor of K={idx.shape[1]}")
    if sum_rows < 1 or x.shape[0] % sum_rows:
        raise ValueError(f"sum_rows={sum_rows} must be a positive divisor of the number of rows "
                         f"M={x.shape[0]}")
    if sum_rows > 1 and (gates is None or groups != 1):
        raise ValueError("sum_rows > 1 needs gates and groups=1 (it sums gated rows)")
    if batch is not None and (gates is None or sum_rows != 1 or batch < 1 or x.shape[0] % batch):
        raise ValueError(f"batch={batch} needs gates, sum_rows=1 and must divide the number of "
                         f"rows M={x.shape[0]}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")


def check_plan(plan: RoutingPlan, idx: torch.Tensor, num_experts: int) -> None:
    if plan.num_experts != num_experts or plan.num_pairs != idx.numel():
        raise ValueError(f"plan was built for {plan.num_pairs} pairs over {plan.num_experts} "
                         f"experts, but idx has {idx.numel()} pairs and w has {num_experts} "
                         "experts")


def expert_matmul(
    x_MD: torch.Tensor,
    idx_MK: torch.Tensor,
    w_EDF: torch.Tensor,
    gates_MK: torch.Tensor | None = None,
    *,
    groups: int = 1,
    sum_rows: int = 1,
    impl: str = "auto",
    plan: RoutingPlan | None = None,
    batch: int | None = None,
) -> torch.Tensor:
    """Multiply each row by the weights of each of its experts (see the module docstring).

    Returns [M, K, F] without gates; with gates the gate-weighted sum over K, [M, F], or with
    ``groups=G`` the sums over G consecutive equal groups of K, [M, G, F]; with
    ``sum_rows=R`` (gated, groups=1) also summed over every R consecutive rows, [M / R, F].
    ``batch=B`` (gated): rows are B sequences of S = M / B, and the result is laid out
    [B, G, S, F], group-major per sequence as attention takes it (contiguous from "sets", a
    view otherwise). ``plan`` (from ``make_plan(idx_MK, E)``) lets several calls share one sort.
    ``impl``: a registered kernel or "auto" (``moeify.ops.moe.policy.choose_impl``). Under
    torch.compile the call is the registered op, which runs a slot-layout kernel: one named
    here, or else the policy's choice ("reference", "gather", "pairs", "all" and "sets" give
    way to it: ``policy.compiled_impl``).
    """
    # Autocast's matmul policy applied to the operands, then every kernel runs in their dtype
    # with autocast off (moeify.ops.amp: the same result dtype on every device).
    x_MD, w_EDF = autocast_cast(x_MD, w_EDF)
    validate(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows, batch)
    E = w_EDF.shape[0]
    if plan is not None:
        check_plan(plan, idx_MK, E)
    with autocast_off(x_MD.device.type):
        if torch.compiler.is_compiling():
            y = compiled.expert_matmul_op(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows,
                                          plan, impl)
        else:
            y = run(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows, impl, plan, batch)
    if batch is None or y.dim() == 4:  # laid out by the kernel
        return y
    M, Fo = x_MD.shape[0], w_EDF.shape[-1]
    return y.view(batch, M // batch, groups, Fo).transpose(1, 2)


def run(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows, impl, plan, batch=None):
    """The eager expert matmul on validated operands, autocast off."""
    E = w_EDF.shape[0]
    k = idx_MK.shape[1] // groups
    if plan is None and not policy.planless(impl):
        plan = make_plan(idx_MK, E)
    name = policy.choose_impl(impl, x_MD, w_EDF, plan, k=k, gated=gates_MK is not None)
    kernel = get_kernel(name)
    with trace(name):
        if isinstance(kernel, ExpertKernel):
            lay = kernel.layout(plan)
            y = ExpertMatmulFunction.apply(x_MD, w_EDF, gates_MK, kernel, lay,
                                           idx_MK.shape[1], groups, sum_rows)
            return y
        if plan is None:  # make_plan has checked them otherwise
            check_ids(idx_MK, E)
        return kernel.run(x_MD, idx_MK, w_EDF, gates_MK, groups=groups, sum_rows=sum_rows,
                          plan=plan, batch=batch)


__all__ = ["TRACE_PREFIX", "check_plan", "expert_matmul", "run", "trace", "validate"]
