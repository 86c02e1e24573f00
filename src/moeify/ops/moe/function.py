"""The one autograd Function over every slot-layout kernel, and the math it runs (shared with
the registered op of moeify.ops.moe.compiled).

Shape legend: M rows, K experts per row, E experts, N = M · K pairs, P slots, D input width,
F output width, G groups, R rows summed per output.

Forward: the rows gathered into the kernel's slots (unless it reads them itself), its GEMMs,
the shared combine (moeify.ops.moe.combine). Backward: the output gradient taken to the slots
(``spread``); d/dgate on the narrower side (g · ys from the kept [P, F] products for F < D or a
kernel that reads rows itself, g · (xs W) for a kernel that keeps nothing, ga · xs for D <= F); d/dx through the kernel's input-gradient
entry point, summed over a row's pairs with its gates; d/dW through its weight-gradient entry
point with the gate multiplied into the narrower side. Saved: x, w, the gates and those narrow
products; the gathered rows are rebuilt.
"""

from __future__ import annotations

import torch

from moeify.ops.amp import amp_backward, amp_forward, autocast_off
from moeify.ops.moe.combine import combine, per_output, spread
from moeify.ops.moe.layout import SlotLayout, gather_rows, row_dot, slot_sums
from moeify.ops.moe.registry import ExpertKernel


# The math over any slot-layout kernel (shared by the autograd Function and the compiled op).


def matmul_forward(kernel: ExpertKernel, x_MD, w_EDF, gates_MK, lay: SlotLayout, k: int,
                   groups: int, sum_rows: int, keep_products: bool):
    """(y, ys): the expert matmul's output, and the per-slot products [P, F] when
    ``keep_products`` (the gate gradient is then a dot with them: ``keeps_products``), else
    None."""
    if kernel.gathers_rows:
        ys_PF = kernel.forward(x_MD, w_EDF, lay, k)
    else:
        ys_PF = kernel.forward(gather_rows(x_MD, lay, lay.rows(k)), w_EDF, lay)
    y = combine(ys_PF, gates_MK, k, groups, sum_rows, None if lay.identity else lay.slot_N)
    return y, (ys_PF if keep_products else None)


def keeps_products(kernel: ExpertKernel, x_MD, w_EDF, gates_MK) -> bool:
    """Whether the forward keeps the narrow products for the gate gradient: when the gates need
    a gradient and either the kernel reads rows itself (no gathered rows to take it from) or
    the products are the narrower side (F < D: a dot over F, where the rows would need the
    gather and a second GEMM) and the kernel keeps them (``keeps_narrow_products``)."""
    if gates_MK is None or not gates_MK.requires_grad:
        return False
    return kernel.gathers_rows or (kernel.keeps_narrow_products
                                   and w_EDF.shape[-1] < x_MD.shape[1])


def matmul_backward(kernel: ExpertKernel, grad_y, x_MD, w_EDF, gates_MK, ys_PF,
                    lay: SlotLayout, k: int, groups: int, sum_rows: int,
                    need_x: bool, need_w: bool, need_g: bool):
    """(grad_x, grad_w, grad_gates), None where not needed. ``ys_PF``: the products the
    forward kept, or None."""
    with autocast_off(x_MD.device.type):  # a backward() called inside an autocast region
        return _backward(kernel, grad_y, x_MD, w_EDF, gates_MK, ys_PF, lay, k, groups, sum_rows,
                         need_x, need_w, need_g)


def _backward(kernel, grad_y, x_MD, w_EDF, gates_MK, ys_PF, lay, k, groups, sum_rows,
              need_x, need_w, need_g):
    M, D = x_MD.shape
    E, _, Fo = w_EDF.shape
    gated = gates_MK is not None
    need_g = need_g and gated
    grad_x = grad_w = grad_gates = None
    # (spread may return grad_y itself: it is never modified in place below.)
    g_PF = spread(grad_y.to(x_MD.dtype), lay, per_output(k, groups, sum_rows, gated))
    gate_N = gates_MK.reshape(-1).to(x_MD.dtype) if gated else None
    gate_P = gather_rows(gate_N[:, None], lay, lay.pair_P) if gated else None  # 0 in padding

    def pairs(v_P):  # per-slot values in pair order
        return (v_P if lay.identity else v_P.index_select(0, lay.slot_N)).view(M, k)

    if need_g and ys_PF is not None:  # d/dgate = g · (x W), from the kept products
        grad_gates = pairs(row_dot(g_PF, ys_PF))
    if kernel.gathers_rows:
        # The kernel reads x through the layout; the gates scale the output gradient first.
        gs_PF = g_PF * gate_P if gated else g_PF
        if need_x:
            grad_x = kernel.input_grad(gs_PF, w_EDF, lay, k, M)
        if need_w:
            grad_w = kernel.weight_grad(x_MD, gs_PF, lay, E, k)
    else:
        need_g = need_g and grad_gates is None
        ga_PD = None
        if need_x or (need_g and D <= Fo):
            # ga = g Wᵀ, the slot's output gradient before gating taken back through its
            # expert: d/dx sums gate · ga over a row's pairs, d/dgate = ga · xs.
            ga_PD = kernel.input_grad(g_PF, w_EDF, lay)
            if need_x:
                grad_x = slot_sums(ga_PD, lay.slot_N, gate_N, k)
        if need_g or need_w:
            # Unless d/dgate = ga · xs, ga is no longer needed: the rows are gathered into its
            # buffer, so the two [P, D] tensors are never alive together. (For D > F with
            # nothing kept, d/dgate = g · (xs W): one more GEMM on the narrow side.)
            reuse = ga_PD if ga_PD is not None and not (need_g and D <= Fo) else None
            xs_PD = gather_rows(x_MD, lay, lay.rows(k), out=reuse)
            if need_g:
                grad_gates = pairs(row_dot(ga_PD, xs_PD) if D <= Fo else
                                   row_dot(kernel.forward(xs_PD, w_EDF, lay), g_PF))
            if need_w:
                if gated:  # the gate multiplied into the narrower side
                    if D <= Fo:
                        xs_PD.mul_(gate_P)  # our own gather
                    elif lay.identity:  # g may be the caller's gradient itself
                        g_PF = g_PF * gate_P
                    else:
                        g_PF.mul_(gate_P)
                grad_w = kernel.weight_grad(xs_PD, g_PF, lay, E)
    if grad_gates is not None:
        grad_gates = grad_gates.to(gates_MK.dtype)
    return grad_x, grad_w, grad_gates


class ExpertMatmulFunction(torch.autograd.Function):
    """The expert matmul over any slot-layout kernel (module docstring); inputs validated."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_MD, w_EDF, gates_MK, kernel, lay, k, groups, sum_rows):
        keep = keeps_products(kernel, x_MD, w_EDF, gates_MK)
        y, ys_PF = matmul_forward(kernel, x_MD, w_EDF, gates_MK, lay, k, groups, sum_rows, keep)
        ctx.save_for_backward(x_MD, w_EDF, gates_MK, ys_PF)
        ctx.meta = (kernel, lay, k, groups, sum_rows)
        ctx.plan = lay.plan if kernel.reads_plan else None  # the layout holds it weakly
        return y

    @staticmethod
    @amp_backward
    def backward(ctx, grad_y):
        x_MD, w_EDF, gates_MK, ys_PF = ctx.saved_tensors
        grads = matmul_backward(*ctx.meta[:1], grad_y, x_MD, w_EDF, gates_MK, ys_PF,
                                *ctx.meta[1:], *ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None, None)


__all__ = ["ExpertMatmulFunction", "keeps_products", "matmul_backward", "matmul_forward"]
