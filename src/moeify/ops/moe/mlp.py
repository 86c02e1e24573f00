"""The expert MLP: two expert matmuls with a ReLU between them, in one sorted layout.

Shape legend
    M  rows (tokens)     K  experts per row      E  experts       N = M * K routed pairs
    D  model width       G  expert hidden width  P  slots (N, or more with padding)

    y[m] = Σ_k gates[m, k] · ReLU(x[m] @ w1[idx[m, k]]) @ w2[idx[m, k]]            -> [M, D]

sigma-MoE (arXiv 2310.10837) and the Switch feedforward (arXiv 2101.03961) are this function.
Written as two ``expert_matmul`` calls (the reference, ``impl="reference"`` or "gather", and the
path taken with dropout on the hidden units), each call gathers the rows into the kernel's slots and sums
back, so the hidden activations make a round trip through pair order between the two matmuls.
Here the rows are gathered into the slots once, both matmuls and the ReLU run there, and the
gated sum over a row's K pairs goes straight back to [M, D] (one ``embedding_bag``,
``slot_sums``), as Hugging Face's grouped experts and MegaBlocks do. Any registered
slot-layout kernel that is handed gathered rows runs it (the one the policy picks for the first
matmul: "padded", "segment", "grouped"). A kernel that reads rows itself runs its own
``sorted_mlp`` ("triton": the first matmul reads x through the sort and writes the hidden
units in expert order, the second reads them there and writes pair order: ScatterMoE's
grouped_out / grouped_in, arXiv 2403.08245; no [N, D] copy of x, no round trip of the hidden
units through pair order); the others take the composite path.

The gated (SwiGLU) expert MLP of Mixtral, Qwen-MoE and OLMoE, ``gated_expert_mlp``, is the
composite form with a gate (Shazeer 2020, Eq. 6, per expert): three expert matmuls sharing one
plan, so every kernel, its reference and its gradients, serves it too.

Backward, with a = ReLU(x W1) kept (the only activation saved, [P, G]) and g the output gradient
gathered per slot: ga = g W2ᵀ; d/dgate = ga · a (a dot over G, not D); dh = gate · ga where
a > 0; dW2 = (gate · a)ᵀ g; dW1 = xsᵀ dh with the gathered rows xs rebuilt; dx = Σ over a row's
pairs of dh W1ᵀ (one more embedding_bag).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeify.ops.amp import amp_backward, amp_forward, autocast_cast, autocast_off
from moeify.ops.moe import policy
from moeify.ops.moe.layout import gather_rows, row_dot, sums_to_rows
from moeify.ops.moe.matmul import check_plan, expert_matmul, trace, validate
from moeify.ops.moe.plan import RoutingPlan, make_plan
from moeify.ops.moe.registry import ExpertKernel, get_kernel


class _ExpertMLP(torch.autograd.Function):
    """y = expert MLP over a sorted or padded layout (module docstring). Pre-validated inputs.
    ``k``: experts per row (``gates_MK`` [M, k]); None: a variable-k plan (``lay.plan.row_N``,
    gates [N] per pair; moeify.ops.moe.pairs)."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_MD, w1_EDG, w2_EGD, gates_MK, kernel, lay, k):
        a_PG = torch.relu_(kernel.forward(gather_rows(x_MD, lay, lay.input_rows(k)), w1_EDG,
                                          lay))
        gate_N = gates_MK.reshape(-1).to(x_MD.dtype)
        y = sums_to_rows(kernel.forward(a_PG, w2_EGD, lay), lay, gate_N, k)
        ctx.save_for_backward(x_MD, w1_EDG, w2_EGD, gate_N, a_PG)
        ctx.meta = (kernel, lay, k, gates_MK.dtype, gates_MK.shape)
        # the layout holds its plan weakly: keep it for the backward where it is read (variable k
        # reads its rows there whatever the kernel)
        ctx.plan = lay.plan if (kernel.reads_plan or k is None) else None
        return y

    @staticmethod
    @amp_backward
    def backward(ctx, grad_y):
        x_MD, w1_EDG, w2_EGD, gate_N, a_PG = ctx.saved_tensors
        kernel, lay, k, gate_dtype, gate_shape = ctx.meta
        row_P = lay.input_rows(k)
        E = w1_EDG.shape[0]
        need_x, need_w1, need_w2, need_g = ctx.needs_input_grad[:4]
        grad_x = grad_w1 = grad_w2 = grad_gates = None
        g_PD = gather_rows(grad_y.contiguous(), lay, row_P)  # contiguous: stride-0 gradients
        gate_P = gather_rows(gate_N[:, None], lay, lay.pair_P)  # [P, 1], 0 in padding slots
        if need_w2:
            grad_w2 = kernel.weight_grad(a_PG * gate_P, g_PD, lay, E)
        ga_PG = kernel.input_grad(g_PD, w2_EGD, lay)
        del g_PD
        if need_g:
            grad_gates = row_dot(ga_PG, a_PG).index_select(0, lay.slot_N)
            grad_gates = grad_gates.view(gate_shape).to(gate_dtype)
        # dh = gate · ga where the unit was active (a > 0 exactly where x W1 > 0).
        dh_PG = torch.ops.aten.threshold_backward(ga_PG.mul_(gate_P), a_PG, 0)
        del ga_PG
        if need_w1:
            grad_w1 = kernel.weight_grad(gather_rows(x_MD, lay, row_P), dh_PG, lay, E)
        if need_x:
            grad_x = sums_to_rows(kernel.input_grad(dh_PG, w1_EDG, lay), lay, None, k)
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
               plan: RoutingPlan | None = None, dropout: float = 0.0,
               training: bool = False, bias_EG: torch.Tensor | None = None,
               activation=None) -> torch.Tensor:
    """y[m] = Σ_k gates[m, k] · Drop(ReLU(x[m] @ w1[e])) @ w2[e], e = idx[m, k]: [M, D] (module
    docstring). ``impl`` as for expert_matmul (the policy decides "auto"); ``plan`` from
    ``make_plan(idx_MK, E)``. Dropout on the hidden units (when ``training``) takes the
    composite path of two expert matmuls, as do hidden biases ``bias_EG`` [E, G] (added to
    x @ w1[e] before the ReLU; the upcycled models' experts) and an ``activation`` other than
    ReLU (None; an elementwise function such as GELU in place of the ReLU, for experts upcycled
    from a GELU MLP)."""
    # Autocast's matmul policy applied to the operands; the paths below run with autocast off
    # (moeify.ops.amp), the composite one included, so every device returns that dtype.
    x_MD, w1_EDG, w2_EGD = autocast_cast(x_MD, w1_EDG, w2_EGD)
    validate(x_MD, idx_MK, w1_EDG, gates_MK, 1)
    want = (w1_EDG.shape[0], w1_EDG.shape[2], w1_EDG.shape[1])
    if tuple(w2_EGD.shape) != want or w2_EGD.dtype != x_MD.dtype:
        raise ValueError(f"w2 must be [E, G, D] = {list(want)} in the dtype of x ({x_MD.dtype}), "
                         f"got {list(w2_EGD.shape)} {w2_EGD.dtype}")
    E, (M, K) = w1_EDG.shape[0], idx_MK.shape
    if plan is not None:
        check_plan(plan, idx_MK, E)
    elif not policy.planless(impl):
        plan = make_plan(idx_MK, E)
    compiling = torch.compiler.is_compiling()
    # Under torch.compile: a traceable kernel's own MLP, else the composite, two registered
    # expert-matmul ops whose kernel the policy picks inside them (moeify.ops.moe.compiled).
    name = (policy.compiled_impl(impl, x_MD, w1_EDG, n_pairs=idx_MK.numel()) if compiling else
            policy.choose_impl(impl, x_MD, w1_EDG, plan, k=K, gated=True))
    kernel = get_kernel(name) if name != "auto" else None
    plain = not (training and dropout > 0) and bias_EG is None and activation is None
    if plain and getattr(kernel, "mlp", None) is not None and (
            not compiling or policy.traced(name) is not None):
        with autocast_off(x_MD.device.type), trace(name):
            return kernel.mlp(x_MD, idx_MK, w1_EDG, w2_EGD, gates_MK)
    if (plain and not compiling and M and isinstance(kernel, ExpertKernel)
            and kernel.sorted_mlp is not None):
        with trace(name):
            return kernel.sorted_mlp(x_MD, w1_EDG, w2_EGD, gates_MK, plan, K)
    if (compiling or not isinstance(kernel, ExpertKernel) or kernel.gathers_rows or M == 0
            or not plain):
        with autocast_off(x_MD.device.type):
            return _composite(x_MD, idx_MK, w1_EDG, w2_EGD, gates_MK, impl if compiling else name,
                              plan, dropout, training, bias_EG, activation)
    with trace(name):
        return _ExpertMLP.apply(x_MD, w1_EDG, w2_EGD, gates_MK, kernel, kernel.layout(plan), K)


def gated_expert_mlp(x_MD: torch.Tensor, idx_MK: torch.Tensor, w_gate_EDG: torch.Tensor,
                     w_up_EDG: torch.Tensor, w_down_EGD: torch.Tensor, gates_MK: torch.Tensor,
                     *, activation=F.silu, impl: str = "auto", plan: RoutingPlan | None = None,
                     dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """y[m] = Σ_k gates[m, k] · Drop(act(x[m] @ w_gate[e]) ⊙ x[m] @ w_up[e]) @ w_down[e]: [M, D]
    (module docstring; Hugging Face's ``MixtralExperts`` computes the same sum with one loop
    over the experts, stored as ``gate_up_proj`` [E, 2G, D] and ``down_proj`` [E, D, G]).
    ``activation`` is elementwise (SiLU for SwiGLU); ``dropout`` acts on the hidden units when
    ``training``."""
    if w_gate_EDG.shape != w_up_EDG.shape:
        raise ValueError(f"w_gate and w_up must have one shape [E, D, G], got "
                         f"{list(w_gate_EDG.shape)} and {list(w_up_EDG.shape)}")
    E, G = w_gate_EDG.shape[0], w_gate_EDG.shape[2]
    want = (E, G, w_gate_EDG.shape[1])
    if tuple(w_down_EGD.shape) != want:
        raise ValueError(f"w_down must be [E, G, D] = {list(want)}, got {list(w_down_EGD.shape)}")
    M, K = idx_MK.shape
    if plan is None and not policy.planless(impl):
        plan = make_plan(idx_MK, E)
    g_MKG = expert_matmul(x_MD, idx_MK, w_gate_EDG, impl=impl, plan=plan)
    u_MKG = expert_matmul(x_MD, idx_MK, w_up_EDG, impl=impl, plan=plan)
    h_NG = F.dropout(activation(g_MKG) * u_MKG, dropout, training).reshape(M * K, G)
    return expert_matmul(h_NG, idx_MK.reshape(M * K, 1), w_down_EGD,
                         gates_MK.reshape(M * K, 1).to(h_NG.dtype), sum_rows=K, impl=impl,
                         plan=plan)


__all__ = ["expert_mlp", "gated_expert_mlp"]
