"""The expert MLP: two expert matmuls with a ReLU between them, in one sorted layout.

Shape legend
    M  rows (tokens)     K  experts per row      E  experts       N = M * K routed pairs
    D  model width       G  expert hidden width  P  slots (N, or more with padding)

    y[m] = Σ_k gates[m, k] · ReLU(x[m] @ w1[idx[m, k]]) @ w2[idx[m, k]]            -> [M, D]

sigma-MoE and the Switch feedforward are this function (moe-family.md). Written as two
``expert_matmul`` calls (the reference, ``impl="reference"`` or "gather", and the path taken
with dropout on the hidden units), each call sorts the pairs into expert order and back, so the
hidden activations make a round trip through pair order between the two matmuls. Here the rows
are gathered into expert order once, both matmuls and the ReLU run there, and the gated sum over
a row's K pairs goes straight back to [M, D] (one ``embedding_bag``, ``slot_sums``), as Hugging
Face's grouped experts and MegaBlocks do. The layout is the one ``choose_impl`` picks for the
first matmul: "padded" (one batched matmul over blocks of one expert, moeify.ops.padded_matmul)
or the sorted rows of "segment" / "grouped".

Backward, with a = ReLU(x W1) kept (the only activation saved, [P, G]) and g the output gradient
gathered per slot: ga = g W2ᵀ; d/dgate = ga · a (a dot over G, not D); dh = gate · ga where
a > 0; dW2 = (gate · a)ᵀ g; dW1 = xsᵀ dh with the gathered rows xs rebuilt; dx = Σ over a row's
pairs of dh W1ᵀ (one more embedding_bag).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeify.ops.amp import amp_backward, amp_forward, autocast_cast, autocast_off
from moeify.ops.expert_matmul import (
    PLANLESS,
    ExpertPlan,
    _sorted_mm,
    _sorted_weight_grad,
    _validate,
    choose_impl,
    expert_matmul,
    make_plan,
    trace,
)
from moeify.ops.padded_matmul import _block_weights, _row_dot, gather_rows, padded_layout, slot_sums

FUSED = ("segment", "grouped", "padded")


class _SortedLayout:
    """The sorted rows of "segment" / "grouped" seen as a layout without padding."""

    def __init__(self, plan: ExpertPlan):
        self.plan = plan
        self.pair_P = plan.order_N
        self.slot_N = plan.inverse_N
        self.pad_P = plan.order_N[:0]


def _layout(kind: str, plan: ExpertPlan):
    return padded_layout(plan) if kind == "padded" else _SortedLayout(plan)


def _mm(kind, a_PA, w_EAB, lay, transpose=False):
    """[P, B] (or [P, A] with ``transpose``): every slot's row times its expert's matrix."""
    w = w_EAB.transpose(1, 2) if transpose else w_EAB
    if kind != "padded":
        return _sorted_mm(kind, a_PA, w, lay.plan)
    L, b = lay.n_blocks, lay.block
    return torch.bmm(a_PA.view(L, b, -1), _block_weights(w, lay)).view(L * b, w.shape[-1])


def _weight_grad(kind, a_PA, g_PB, lay, E):
    """Σ over each expert's slots of aᵀ g: [E, A, B]."""
    if kind != "padded":
        return _sorted_weight_grad(kind, a_PA, g_PB.contiguous(), lay.plan)
    L, b = lay.n_blocks, lay.block
    gw = torch.bmm(a_PA.view(L, b, -1).transpose(1, 2), g_PB.view(L, b, -1))
    if lay.block_expert is None:
        return gw
    return gw.new_zeros(E, *gw.shape[1:]).index_add_(0, lay.block_expert, gw)


class _ExpertMLP(torch.autograd.Function):
    """y = expert MLP over a sorted or padded layout (module docstring). Pre-validated inputs."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_MD, w1_EDG, w2_EGD, gates_MK, kind, lay, k):
        row_P = torch.div(lay.pair_P, k, rounding_mode="floor")
        xs_PD = gather_rows(x_MD, lay, row_P)
        a_PG = torch.relu_(_mm(kind, xs_PD, w1_EDG, lay))
        del xs_PD
        gate_N = gates_MK.reshape(-1).to(x_MD.dtype)
        y = slot_sums(_mm(kind, a_PG, w2_EGD, lay), lay.slot_N, gate_N, k)
        ctx.save_for_backward(x_MD, w1_EDG, w2_EGD, gate_N, a_PG, row_P)
        ctx.meta = (kind, lay, k, gates_MK.dtype)
        return y

    @staticmethod
    @amp_backward
    def backward(ctx, grad_y):
        x_MD, w1_EDG, w2_EGD, gate_N, a_PG, row_P = ctx.saved_tensors
        kind, lay, k, gate_dtype = ctx.meta
        M, E = x_MD.shape[0], w1_EDG.shape[0]
        need_x, need_w1, need_w2, need_g = ctx.needs_input_grad[:4]
        grad_x = grad_w1 = grad_w2 = grad_gates = None
        g_PD = gather_rows(grad_y.contiguous(), lay, row_P)  # contiguous: stride-0 gradients
        gate_P = gather_rows(gate_N[:, None], lay, lay.pair_P)  # [P, 1], 0 in padding slots
        if need_w2:
            grad_w2 = _weight_grad(kind, a_PG * gate_P, g_PD, lay, E)
        ga_PG = _mm(kind, g_PD, w2_EGD, lay, transpose=True)
        del g_PD
        if need_g:
            grad_gates = _row_dot(ga_PG, a_PG).index_select(0, lay.slot_N)
            grad_gates = grad_gates.view(M, k).to(gate_dtype)
        # dh = gate · ga where the unit was active (a > 0 exactly where x W1 > 0).
        dh_PG = torch.ops.aten.threshold_backward(ga_PG.mul_(gate_P), a_PG, 0)
        del ga_PG
        if need_w1:
            grad_w1 = _weight_grad(kind, gather_rows(x_MD, lay, row_P), dh_PG, lay, E)
        if need_x:
            grad_x = slot_sums(_mm(kind, dh_PG, w1_EDG, lay, transpose=True), lay.slot_N,
                               None, k)
        return grad_x, grad_w1, grad_w2, grad_gates, None, None, None


def _composite(x_MD, idx_MK, w1_EDG, w2_EGD, gates_MK, impl, plan, dropout, training,
               bias_EG=None, activation=None):
    """The two expert matmuls as written (the reference, and the path with hidden dropout,
    hidden biases or an activation other than ReLU)."""
    M, K = idx_MK.shape
    h_MKG = expert_matmul(x_MD, idx_MK, w1_EDG, impl=impl, plan=plan)
    if bias_EG is not None:
        h_MKG = h_MKG + bias_EG[idx_MK].to(h_MKG.dtype)
    act = F.relu if activation is None else activation
    h_NG = F.dropout(act(h_MKG), dropout, training).reshape(M * K, w1_EDG.shape[-1])
    return expert_matmul(h_NG, idx_MK.reshape(M * K, 1), w2_EGD, gates_MK.reshape(M * K, 1),
                         sum_rows=K, impl=impl, plan=plan)


def expert_mlp(x_MD: torch.Tensor, idx_MK: torch.Tensor, w1_EDG: torch.Tensor,
               w2_EGD: torch.Tensor, gates_MK: torch.Tensor, *, impl: str = "auto",
               plan: ExpertPlan | None = None, dropout: float = 0.0,
               training: bool = False, bias_EG: torch.Tensor | None = None,
               activation=None) -> torch.Tensor:
    """y[m] = Σ_k gates[m, k] · Drop(ReLU(x[m] @ w1[e])) @ w2[e], e = idx[m, k]: [M, D] (module
    docstring). ``impl`` as for expert_matmul (``choose_impl`` decides "auto"); ``plan`` from
    ``make_plan(idx_MK, E)``. Dropout on the hidden units (when ``training``) takes the
    composite path of two expert matmuls, as do hidden biases ``bias_EG`` [E, G] (added to
    x @ w1[e] before the ReLU; the upcycled models' experts) and an ``activation`` other than
    ReLU (None; an elementwise function such as GELU in place of the ReLU, for experts upcycled
    from a GELU MLP)."""
    # Autocast's matmul policy applied to the operands; the paths below run with autocast off
    # (moeify.ops.amp), the composite one included, so every device returns that dtype.
    x_MD, w1_EDG, w2_EGD = autocast_cast(x_MD, w1_EDG, w2_EGD)
    _validate(x_MD, idx_MK, w1_EDG, gates_MK, 1)
    want = (w1_EDG.shape[0], w1_EDG.shape[2], w1_EDG.shape[1])
    if tuple(w2_EGD.shape) != want or w2_EGD.dtype != x_MD.dtype:
        raise ValueError(f"w2 must be [E, G, D] = {list(want)} in the dtype of x ({x_MD.dtype}), "
                         f"got {list(w2_EGD.shape)} {w2_EGD.dtype}")
    E, (M, K) = w1_EDG.shape[0], idx_MK.shape
    if plan is None and impl not in PLANLESS:
        plan = make_plan(idx_MK, E)
    kind = choose_impl(impl, x_MD, w1_EDG, plan, k=K, gated=True)
    if (kind not in FUSED or M == 0 or (training and dropout > 0) or bias_EG is not None
            or activation is not None):
        with autocast_off(x_MD.device.type):
            return _composite(x_MD, idx_MK, w1_EDG, w2_EGD, gates_MK, kind, plan, dropout,
                              training, bias_EG, activation)
    if plan.num_experts != E or plan.num_pairs != idx_MK.numel():
        raise ValueError(f"plan was built for {plan.num_pairs} pairs over {plan.num_experts} "
                         f"experts, but idx has {idx_MK.numel()} pairs and w1 has {E} experts")
    with trace(kind):
        return _ExpertMLP.apply(x_MD, w1_EDG, w2_EGD, gates_MK, kind, _layout(kind, plan), K)


__all__ = ["expert_mlp"]
