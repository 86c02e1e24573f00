"""The dense-over-experts kernel ("concat"): one GEMM over every expert's matrix concatenated,
the routing applied as a dense gate matrix before or after it.

Shape legend
    M  rows        K  experts per row      E  experts         G  output groups
    R  rows summed per output              T  = M / R output rows
    A  input width (D)                     B  output width (F)   H  hidden width (expert MLP)

Sorted kernels multiply each routed (row, expert) pair once, but pay for what the routing costs
around the GEMM: a sort, gathers into expert order, a scatter (or atomics) back, and GEMMs whose
sizes depend on the routing. With few, narrow experts (SwitchHead: E = 5 per head, K = 2,
width 76) that overhead is as large as the GEMMs. TensorRT-LLM runs small-batch MoE layers as
one dense GEMM over all experts concatenated, the per-(token, expert) gates applied in the
epilogue. The same trade here: E/K times the multiply-adds, but one large GEMM, no sort, no
gather, no scatter, no atomics, no host read-back and shapes that depend only on the operands
(torch.compile traces it in place, CUDA graphs capture it).

The routing enters as the gates scattered over every expert (``dense_gates``): gate_MGE
[M, G, E], zero for the experts a row did not select (repeated ids add). Two forms:

    V (gates on the output; SwitchHead's V and K experts, the first matmul of an MLP):
        Y = x @ W_cat                        W_cat [A, E·B] (the E matrices side by side)
        y[t, g] = Σ_{r, e} gate[t·R + r, g, e] · Y[t·R + r, e]                 -> [T, G, B]
    O (gates on the input; SwitchHead's O and Q experts, an MLP's second matmul):
        Z[t, g, e] = Σ_r gate[t·R + r, g, e] · x[t·R + r]                      [T·G, E·A]
        y = Z @ W_cat                        W_cat [E·A, B] (the E matrices stacked: a view)

The GEMM's rows are M in the V form and T·G in the O form, so the O form is taken where it
has fewer (``sum_rows`` > 1: SwitchHead's output experts sum the H heads of a token), or the
narrower intermediate on a tie (A < B). Without gates the output is the V form's pick of each
pair's product ([M, K, B], the gate matrix one-hot).

Backward (a custom autograd Function): "concat" saves only x, w and the gate matrix, never the
[M, E·B] or [T·G, E·A] intermediate; the V form recomputes Y for the gate gradient (one more
GEMM, only when the gates need a gradient), the O form recomputes Z (elementwise). The gate
gradient reaches the routed gates through ``dense_gates``' scatter (a gather).

"concat_saved" is the same kernel keeping the intermediate instead (``keep``): the V form's Y
when the gates need a gradient (no GEMM recomputed), the O form's Z when the weights do (no
recompute of the gated inputs), the MLP's hidden units a = relu(x @ W1_cat) (its backward then
runs three GEMMs, not four). It holds E/K times the routed products from the forward to the
backward, so whether it pays (a GEMM saved against that memory) is a measurement per device:
both are registered, and the benches, the device table and the cost contract carry both.

The expert MLP (``concat_mlp``) chains the two: y = (relu(x @ W1_cat) ⊙ gate) @ W2_cat, two GEMMs
in the forward and the hidden units never leave expert order.

Any number of experts per row is a gate matrix: the core (``ConcatMatmul``, ``ConcatMLP``)
takes gate_MGE, not ids, so routings that select a variable number of experts per row need no
other kernel.

Numerics: a product of an expert the row did not select is multiplied by a zero gate, so a
non-finite product there (an overflow in float16) makes that output NaN, as in the
``reference`` kernel; the sorted kernels never compute it.
"""

from __future__ import annotations

import torch

from moeify.ops.amp import amp_backward, amp_forward
from moeify.ops.moe.combine import dense_gates
from moeify.ops.moe.registry import WholeKernel, register


def outer_form(gated: bool, groups: int, sum_rows: int, a: int, b: int) -> bool:
    """Whether the O form (gates on the input) runs: gated, and fewer GEMM rows (sum_rows > 1)
    or, on a tie, the narrower intermediate (module docstring)."""
    return gated and (sum_rows > 1 or (groups == 1 and a < b))


def _side_by_side(w_EAB: torch.Tensor) -> torch.Tensor:
    """W_cat [A, E·B]: the E matrices side by side (a copy of the weights)."""
    E, A, B = w_EAB.shape
    return w_EAB.permute(1, 0, 2).reshape(A, E * B)


def _gate_rows(gate_MGE: torch.Tensor, R: int) -> torch.Tensor:
    """The gate matrix as [T, G, R·E] (G = 1 or R = 1): output row t's gates over the products
    of its R rows."""
    M, G, E = gate_MGE.shape
    return gate_MGE.reshape(M // R, G, R * E)


def _inputs_on_experts(x_MA: torch.Tensor, gate_MGE: torch.Tensor, R: int) -> torch.Tensor:
    """Z [T, G·E, A]: the gated inputs laid on the concatenated axis (O form)."""
    M, G, E = gate_MGE.shape
    if R == 1:  # an outer product per row
        return gate_MGE.reshape(M, G * E, 1) * x_MA.unsqueeze(1)
    return torch.bmm(gate_MGE.reshape(M // R, R, G * E).transpose(1, 2),
                     x_MA.view(M // R, R, -1))


class ConcatMatmul(torch.autograd.Function):
    """y [T, G, B] = the expert matmul with the gate matrix gate_MGE [M, G, E], summed over
    R = ``sum_rows`` rows (G = 1 or R = 1), in the V or the O form (module docstring).
    Operands share a dtype. ``keep``: save the intermediate (Y in the V form, Z in the O form)
    for the backward instead of recomputing it; the caller passes it only where the backward
    reads it (``concat_matmul``)."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_MA, w_EAB, gate_MGE, sum_rows: int, outer: bool, keep: bool = False):
        M, A = x_MA.shape
        E, _, B = w_EAB.shape
        G, R = gate_MGE.shape[1], sum_rows
        T = M // R
        if outer:
            z = _inputs_on_experts(x_MA, gate_MGE, R).reshape(T * G, E * A)
            y = (z @ w_EAB.reshape(E * A, B)).view(T, G, B)
            kept = z if keep else None
        else:
            y_MEB = (x_MA @ _side_by_side(w_EAB)).view(T, R * E, B)
            y = torch.bmm(_gate_rows(gate_MGE, R), y_MEB)
            kept = y_MEB if keep else None
        ctx.save_for_backward(x_MA, w_EAB, gate_MGE, kept)
        ctx.meta = (R, outer)
        return y

    @staticmethod
    @amp_backward
    def backward(ctx, grad_y):
        x_MA, w_EAB, gate_MGE, kept = ctx.saved_tensors
        R, outer = ctx.meta
        need_x, need_w, need_g = ctx.needs_input_grad[:3]
        M, A = x_MA.shape
        E, _, B = w_EAB.shape
        G = gate_MGE.shape[1]
        T = M // R
        g_TGB = grad_y.reshape(T, G, B)
        grad_x = grad_w = grad_gate = None
        if outer:
            g_OB = g_TGB.reshape(T * G, B)
            if need_x or need_g:
                dz = (g_OB @ w_EAB.reshape(E * A, B).t()).view(T, G * E, A)
                if need_x:
                    grad_x = torch.bmm(gate_MGE.reshape(T, R, G * E), dz).view(M, A)
                if need_g:
                    grad_gate = torch.bmm(x_MA.view(T, R, A), dz.transpose(1, 2)).view(M, G, E)
                del dz
            if need_w:
                z = (kept if kept is not None else
                     _inputs_on_experts(x_MA, gate_MGE, R).reshape(T * G, E * A))
                grad_w = (z.t() @ g_OB).view(E, A, B)
        else:
            w_AX = _side_by_side(w_EAB)
            if need_x or need_w:
                # dY[m, e] = Σ_g gate[m, g, e] · g[t, g]: the gated output gradient per expert.
                dy = torch.bmm(_gate_rows(gate_MGE, R).transpose(1, 2), g_TGB).view(M, E * B)
                if need_x:
                    grad_x = dy @ w_AX.t()
                if need_w:
                    grad_w = (x_MA.t() @ dy).view(A, E, B).permute(1, 0, 2)
                del dy
            if need_g:  # Y kept, or recomputed: one GEMM instead of an [M, E·B] tensor kept
                y_TXB = kept if kept is not None else (x_MA @ w_AX).view(T, R * E, B)
                grad_gate = torch.bmm(g_TGB, y_TXB.transpose(1, 2)).view(M, G, E)
        return grad_x, grad_w, grad_gate, None, None, None


class ConcatMLP(torch.autograd.Function):
    """y [M, D] = (relu(x @ W1_cat) ⊙ gate) @ W2_cat with gate_ME [M, E] the gates over every
    expert (module docstring): both matmuls dense over the experts. ``keep``: save the hidden
    units a = relu(x @ W1_cat) [M, E·H] instead of recomputing them in the backward."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_MD, w1_EDH, w2_EHD, gate_ME, keep: bool = False):
        M = x_MD.shape[0]
        E, D, H = w1_EDH.shape
        a_MEH = torch.relu((x_MD @ _side_by_side(w1_EDH)).view(M, E, H))
        y = (a_MEH * gate_ME.unsqueeze(-1)).view(M, E * H) @ w2_EHD.reshape(E * H, D)
        ctx.save_for_backward(x_MD, w1_EDH, w2_EHD, gate_ME, a_MEH if keep else None)
        return y

    @staticmethod
    @amp_backward
    def backward(ctx, grad_y):
        x_MD, w1_EDH, w2_EHD, gate_ME, a_MEH = ctx.saved_tensors
        need_x, need_w1, need_w2, need_g = ctx.needs_input_grad[:4]
        M = x_MD.shape[0]
        E, D, H = w1_EDH.shape
        w1_DX = _side_by_side(w1_EDH)
        g_MD = grad_y.reshape(M, D)
        if a_MEH is None:  # recomputed: nothing [M, E·H] was kept
            a_MEH = torch.relu((x_MD @ w1_DX).view(M, E, H))
        grad_x = grad_w1 = grad_w2 = grad_gate = None
        if need_w2:
            grad_w2 = ((a_MEH * gate_ME.unsqueeze(-1)).view(M, E * H).t() @ g_MD).view(E, H, D)
        da_MEH = (g_MD @ w2_EHD.reshape(E * H, D).t()).view(M, E, H)
        if need_g:
            grad_gate = torch.bmm(da_MEH.view(M * E, 1, H), a_MEH.reshape(M * E, H, 1)).view(M, E)
        # dh = gate · da where the unit was active (a > 0 exactly where x W1 > 0).
        dh = torch.ops.aten.threshold_backward(da_MEH.mul_(gate_ME.unsqueeze(-1)), a_MEH, 0)
        dh = dh.view(M, E * H)
        del da_MEH, a_MEH
        if need_w1:
            grad_w1 = (x_MD.t() @ dh).view(D, E, H).permute(1, 0, 2)
        if need_x:
            grad_x = dh @ w1_DX.t()
        return grad_x, grad_w1, grad_w2, grad_gate, None


def concat_matmul(x_MD, idx_MK, w_EDF, gates_MK, *, groups: int = 1, sum_rows: int = 1,
                  keep: bool = False):
    """expert_matmul's contract (moeify.ops.moe.matmul; inputs validated) by the dense form;
    ``keep``: the intermediate saved for the backward ("concat_saved"), where it reads it."""
    M, K = idx_MK.shape
    E, D, Fo = w_EDF.shape
    gated = gates_MK is not None
    if gated:
        gate = dense_gates(idx_MK.reshape(M, groups, K // groups),
                           gates_MK.reshape(M, groups, K // groups), E, x_MD)
    else:  # one output per pair: a one-hot gate per (row, pair)
        gate = dense_gates(idx_MK.reshape(M, K, 1), x_MD.new_ones(M, K, 1), E, x_MD)
    outer = outer_form(gated, groups, sum_rows, D, Fo)
    # The V form's Y serves only the gate gradient, the O form's Z only the weight gradient.
    keep = keep and torch.is_grad_enabled() and (
        w_EDF.requires_grad if outer else gated and gates_MK.requires_grad)
    y = ConcatMatmul.apply(x_MD, w_EDF, gate, sum_rows, outer, keep)
    return y.view(M // sum_rows, Fo) if gated and groups == 1 else y


def concat_mlp(x_MD, idx_MK, w1_EDH, w2_EHD, gates_MK, *, keep: bool = False):
    """expert_mlp's contract (moeify.ops.moe.mlp; inputs validated) by the dense form;
    ``keep``: the hidden units saved for the backward ("concat_saved")."""
    M, K = idx_MK.shape
    gate_ME = dense_gates(idx_MK.view(M, 1, K), gates_MK.view(M, 1, K), w1_EDH.shape[0], x_MD)
    return ConcatMLP.apply(x_MD, w1_EDH, w2_EHD, gate_ME.view(M, -1),
                           keep and torch.is_grad_enabled())


class ConcatKernel(WholeKernel):
    """The dense-over-experts kernel (module docstring): no routing plan, static shapes, traced
    by torch.compile in place of the registered op. Its backward recomputes the intermediate
    over every expert."""

    name = "concat"
    traceable = True
    keep = False  # save the intermediate for the backward instead ("concat_saved")

    def run(self, x_MD, idx_MK, w_EDF, gates_MK, *, groups, sum_rows, plan, batch):
        return concat_matmul(x_MD, idx_MK, w_EDF, gates_MK, groups=groups, sum_rows=sum_rows,
                             keep=self.keep)

    def mlp(self, x_MD, idx_MK, w1_EDH, w2_EHD, gates_MK):
        return concat_mlp(x_MD, idx_MK, w1_EDH, w2_EHD, gates_MK, keep=self.keep)


class ConcatSavedKernel(ConcatKernel):
    """The "concat" kernel keeping the intermediate over every expert for the backward (module
    docstring): one GEMM (or the gated inputs) fewer in the backward, E/K times the routed
    products held from the forward to the backward."""

    name = "concat_saved"
    keep = True
    variant_of = "concat"


register(ConcatKernel())
register(ConcatSavedKernel())

__all__ = ["ConcatKernel", "ConcatMLP", "ConcatMatmul", "ConcatSavedKernel", "concat_matmul",
           "concat_mlp", "outer_form"]
