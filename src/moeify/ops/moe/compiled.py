"""The expert matmul as registered ops (torch.library), for torch.compile.

A compiled graph cannot trace the kernels' layouts (they size their work from the routing's
counts on the host) and must not fall back to a dense matmul over every expert. So under
torch.compile the expert matmul is one op, ``moeify::expert_matmul``, with a fake (meta)
implementation for tracing and its backward registered as a second op,
``moeify::expert_matmul_backward``. Inside them everything runs eagerly: the routing plan is
built from the ids, the policy picks the kernel (``compiled_impl`` at trace time; "auto"
resolved at run time among the slot-layout kernels), and the shared math of
moeify.ops.moe.function runs it. The backward rebuilds the plan from the saved ids (one sort)
rather than saving layouts whose sizes depend on the routing.

Shape legend: M rows, K experts per row, N = M · K pairs, F output width, G groups, R rows
summed per output.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from moeify.ops.moe import policy
from moeify.ops.moe.function import matmul_backward, matmul_forward
from moeify.ops.moe.plan import make_plan
from moeify.ops.moe.registry import get_kernel


def _kernel_and_layout(x, idx, w, gates, groups, impl, group_size):
    """(kernel, layout, plan): the caller holds the plan while it uses the layout (a layout
    refers to its plan weakly, moeify.ops.moe.layout)."""
    plan = make_plan(idx, w.shape[0], group_size=group_size or None)
    name = policy.choose_impl(impl, x, w, plan, k=idx.shape[1] // groups,
                              gated=gates is not None, layouts_only=True)
    kernel = get_kernel(name)
    return kernel, kernel.layout(plan), plan


def _out_shape(x, idx, w, gates, groups, sum_rows):
    M, K = idx.shape
    Fo = w.shape[-1]
    if gates is None:
        return (M, K, Fo)
    return (M // sum_rows, Fo) if groups == 1 else (M, groups, Fo)


@torch.library.custom_op("moeify::expert_matmul", mutates_args=())
def expert_matmul_fwd(x: Tensor, idx: Tensor, w: Tensor, gates: Optional[Tensor], groups: int,
                      sum_rows: int, impl: str, group_size: int,
                      keep_products: bool) -> tuple[Tensor, Tensor]:
    """(y, the per-pair products [N, F] when ``keep_products``, else empty): ``keep_products``
    only for a kernel that reads rows itself and gates that need a gradient (the backward op
    is told the same flag: an empty [0, F] is kept products when there are no rows)."""
    kernel, lay, _plan = _kernel_and_layout(x, idx, w, gates, groups, impl, group_size)
    if keep_products and not kernel.gathers_rows:
        raise ValueError(f"keep_products: kernel {kernel.name!r} does not read rows itself, so "
                         "its backward needs no products")
    y, ys = matmul_forward(kernel, x, w, gates, lay, idx.shape[1], groups, sum_rows,
                           keep_products)
    return y.contiguous(), (ys if ys is not None else x.new_empty(0))


@expert_matmul_fwd.register_fake
def _(x, idx, w, gates, groups, sum_rows, impl, group_size, keep_products):
    N = idx.numel()
    return (x.new_empty(_out_shape(x, idx, w, gates, groups, sum_rows)),
            x.new_empty((N, w.shape[-1]) if keep_products else (0,)))


@torch.library.custom_op("moeify::expert_matmul_backward", mutates_args=())
def expert_matmul_bwd(grad: Tensor, x: Tensor, idx: Tensor, w: Tensor, gates: Optional[Tensor],
                      ys: Tensor, groups: int, sum_rows: int, impl: str, group_size: int,
                      keep_products: bool, need_x: bool, need_w: bool,
                      need_g: bool) -> tuple[Tensor, Tensor, Tensor]:
    kernel, lay, _plan = _kernel_and_layout(x, idx, w, gates, groups, impl, group_size)
    gx, gw, gg = matmul_backward(kernel, grad, x, w, gates, ys if keep_products else None, lay,
                                 idx.shape[1], groups, sum_rows, need_x, need_w, need_g)
    # Distinct empty tensors where not needed: a registered op's outputs must not alias.
    return (gx if gx is not None else x.new_empty(0), gw if gw is not None else w.new_empty(0),
            gg if gg is not None else x.new_empty(0))


@expert_matmul_bwd.register_fake
def _(grad, x, idx, w, gates, ys, groups, sum_rows, impl, group_size, keep_products, need_x,
      need_w, need_g):
    return (x.new_empty(x.shape if need_x else (0,)), w.new_empty(w.shape if need_w else (0,)),
            (gates.new_empty(gates.shape) if need_g and gates is not None else x.new_empty(0)))


def _setup_context(ctx, inputs, output):
    x, idx, w, gates, groups, sum_rows, impl, group_size, keep_products = inputs
    ctx.save_for_backward(x, idx, w, gates, output[1])
    ctx.meta = (groups, sum_rows, impl, group_size, keep_products)


def _backward(ctx, grad, _grad_ys):
    x, idx, w, gates, ys = ctx.saved_tensors
    need_x, _, need_w, need_g = ctx.needs_input_grad[:4]
    need_g = need_g and gates is not None
    gx, gw, gg = expert_matmul_bwd(grad, x, idx, w, gates, ys, *ctx.meta, need_x, need_w, need_g)
    return (gx if need_x else None, None, gw if need_w else None, gg if need_g else None,
            None, None, None, None, None)


expert_matmul_fwd.register_autograd(_backward, setup_context=_setup_context)


def expert_matmul_op(x, idx, w, gates, groups: int, sum_rows: int, plan, impl: str):
    """The expert matmul inside a compiled graph (module docstring): [M, K, F], [M / R, F] or
    [M, G, F]; a traceable kernel (``policy.traced``) is traced in place of the op. ``plan``
    only lends its expert grouping (the op rebuilds the sort)."""
    name = policy.compiled_impl(impl, x, w, n_pairs=idx.numel())
    kernel = policy.traced(name)
    if kernel is not None:  # static shapes: traced in place
        return kernel.run(x, idx, w, gates, groups=groups, sum_rows=sum_rows, plan=None,
                          batch=None)
    group_size = plan.group_size or 0 if plan is not None else 0
    # Products kept only where their shape is known when tracing: the pairs in their own order
    # (a kernel that reads rows itself); the others take the gate gradient from the rows.
    keep = (gates is not None and gates.requires_grad and name != "auto"
            and get_kernel(name).gathers_rows)
    return expert_matmul_fwd(x, idx.to(torch.int64), w, gates, groups, sum_rows, name,
                             group_size, keep)[0]


__all__ = ["expert_matmul_bwd", "expert_matmul_fwd", "expert_matmul_op"]
