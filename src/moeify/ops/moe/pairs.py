"""The expert MLP with a variable number of experts per row (ReMoE's ReLU routing).

Shape legend
    M  rows (tokens)     E  experts     N  routed (row, expert) pairs, any number per row
    D  model width       G  expert hidden width      P  slots of a kernel's layout

The routing is flat lists of pairs: pair n routes row ``row_N[n]`` to expert ``expert_N[n]``
with gate ``gate_N[n]``, the pairs in row order; its plan (``make_pair_plan``) carries the
per-row counts and offsets besides the sort by expert. No row is padded to a fixed k:

    y[m] = Σ_{n: row_N[n] = m} gate_N[n] · act(x[m] @ w1[e_n]) @ w2[e_n],  e_n = expert_N[n]
    (gated: act(x[m] @ w1[e_n]) ⊙ (x[m] @ w_up[e_n]) in place of act(x[m] @ w1[e_n]))

How it runs. A slot-layout kernel that is handed gathered rows ("segment", "grouped",
"padded") runs the ReLU MLP in the expert MLP's autograd Function (moeify.ops.moe.mlp, with
k None): the rows gathered into its slots through ``row_N``, both GEMMs and the ReLU there (its
k-free entry points, one row per slot), and the gated sum over each row's pairs straight back
to [M, D] (``row_sums``: one ``embedding_bag`` whose bags are the rows). Every other kernel
(the ones that read rows themselves, "triton", and the whole-contract ones: "reference",
"gather", "pairs", "all") and the gated, dropout and non-ReLU forms run the composite: each pair's row gathered once ([N, D]), then the
fixed-k contract with K = 1 per gathered row (two or three ``expert_matmul`` calls sharing the
plan), then the sum over each row's pairs. Both are exact for every kernel.

``mask_expert_mlp`` takes the routing as a dense gate matrix [M, E] that is zero exactly where a
row is not routed (ReLU routing's output): its pairs are ``nonzero`` of it. In eager mode that
reads the number of pairs back to the host once (a kernel must size its work); under
torch.compile it is one registered op, ``moeify::mask_expert_mlp`` (output [M, D] whatever the
routing, so the graph has no data-dependent shape), whose backward op recomputes the forward
eagerly and differentiates it. Its gate gradient is given on the routed pairs; it is zero
elsewhere, which is exact behind a ReLU (whose own gradient is zero where its output is).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moeify.ops.amp import autocast_cast, autocast_off
from moeify.ops.moe import policy
from moeify.ops.moe.matmul import expert_matmul, trace
from moeify.ops.moe.mlp import _ExpertMLP
from moeify.ops.moe.plan import RoutingPlan, make_pair_plan
from moeify.ops.moe.registry import ExpertKernel, get_kernel

# Elementwise activations by name (the registered op takes a name, not a function).
ACTIVATIONS = {"relu": F.relu, "silu": F.silu, "gelu": F.gelu,
               "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def _composite(x_MD, plan, w1_EDG, w2_EGD, gate_N, name, w_up_EDG, activation, dropout,
               training):
    """Each pair's row gathered, the fixed-k contract with K = 1 on those rows (any kernel,
    sharing ``plan``), then the sum over each row's pairs (module docstring)."""
    N, G = plan.num_pairs, w1_EDG.shape[-1]
    e_N1 = plan.flat_N.view(N, 1)
    xs_ND = x_MD.index_select(0, plan.row_N)
    h_NG = activation(expert_matmul(xs_ND, e_N1, w1_EDG, impl=name, plan=plan).view(N, G))
    if w_up_EDG is not None:
        h_NG = h_NG * expert_matmul(xs_ND, e_N1, w_up_EDG, impl=name, plan=plan).view(N, G)
    h_NG = F.dropout(h_NG, dropout, training)
    y_ND = expert_matmul(h_NG, e_N1, w2_EGD, gate_N.view(N, 1).to(h_NG.dtype), impl=name,
                         plan=plan)
    return y_ND.new_zeros(plan.n_rows, y_ND.shape[1]).index_add(0, plan.row_N, y_ND)


def pair_expert_mlp(x_MD: torch.Tensor, plan: RoutingPlan, gate_N: torch.Tensor,
                    w1_EDG: torch.Tensor, w2_EGD: torch.Tensor, *,
                    w_up_EDG: torch.Tensor | None = None, activation: str = "relu",
                    impl: str = "auto", dropout: float = 0.0,
                    training: bool = False) -> torch.Tensor:
    """The expert MLP over a variable-k plan (``make_pair_plan``), [M, D] (module docstring).
    ``gate_N`` [N]: each pair's gate. ``w_up_EDG``: the gated (SwiGLU) form's up projection.
    ``activation``: one of ACTIVATIONS by name. ``impl``: a registered kernel or "auto"."""
    if not plan.variable_k:
        raise ValueError("pair_expert_mlp needs a variable-k plan (make_pair_plan); use "
                         "expert_mlp for a fixed number of experts per row")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, "
                         f"got {activation!r}")
    x_MD, w1_EDG, w2_EGD, w_up_EDG = autocast_cast(x_MD, w1_EDG, w2_EGD, w_up_EDG)
    E, D, G = w1_EDG.shape
    if x_MD.dim() != 2 or x_MD.shape != (plan.n_rows, D):
        raise ValueError(f"x must be [M, D] = [{plan.n_rows}, {D}] (the plan's rows, the "
                         f"width of w1), got {tuple(x_MD.shape)}")
    if tuple(w2_EGD.shape) != (E, G, D) or w2_EGD.dtype != x_MD.dtype:
        raise ValueError(f"w2 must be [E, G, D] = [{E}, {G}, {D}] in the dtype of x, got "
                         f"{list(w2_EGD.shape)} {w2_EGD.dtype}")
    if w_up_EDG is not None and (w_up_EDG.shape != w1_EDG.shape
                                 or w_up_EDG.dtype != x_MD.dtype):
        raise ValueError(f"w_up must have the shape of w1 {list(w1_EDG.shape)} and the dtype "
                         f"of x, got {list(w_up_EDG.shape)} {w_up_EDG.dtype}")
    if plan.num_experts != E or gate_N.shape != (plan.num_pairs,):
        raise ValueError(f"the plan has {plan.num_pairs} pairs over {plan.num_experts} experts; "
                         f"gate_N must be [{plan.num_pairs}] and w1 hold {plan.num_experts} "
                         f"experts, got {tuple(gate_N.shape)} and {E}")
    name = policy.choose_impl(impl, x_MD, w1_EDG, plan, k=1, gated=True)
    if name == "sets":
        raise ValueError('impl="sets" lays out sets of a fixed k per row; a variable number of '
                         'experts per row takes another kernel (e.g. "segment" or "auto")')
    kernel = get_kernel(name)
    with autocast_off(x_MD.device.type):
        if (not isinstance(kernel, ExpertKernel) or kernel.gathers_rows or plan.num_pairs == 0
                or w_up_EDG is not None or activation != "relu" or (training and dropout > 0)):
            return _composite(x_MD, plan, w1_EDG, w2_EGD, gate_N, name, w_up_EDG,
                              ACTIVATIONS[activation], dropout, training)
        with trace(name):
            return _ExpertMLP.apply(x_MD, w1_EDG, w2_EGD, gate_N, kernel, kernel.layout(plan),
                                    None)


def mask_pairs(gates_ME: torch.Tensor) -> tuple[RoutingPlan, torch.Tensor]:
    """(plan, gate_N): the routed pairs of a dense gate matrix [M, E], zero exactly where a row
    is not routed, in row order (``nonzero``: one read-back of their number)."""
    M, E = gates_ME.shape
    row_N, expert_N = (gates_ME != 0).nonzero(as_tuple=True)
    return make_pair_plan(row_N, expert_N, M, E, in_range=True), gates_ME[row_N, expert_N]


def _mask_mlp_eager(x, gates, w1, w2, w_up, activation, impl, dropout, training):
    plan, gate_N = mask_pairs(gates)
    return pair_expert_mlp(x, plan, gate_N, w1, w2, w_up_EDG=w_up, activation=activation,
                           impl=impl, dropout=dropout, training=training)


def mask_expert_mlp(x_MD: torch.Tensor, gates_ME: torch.Tensor, w1_EDG: torch.Tensor,
                    w2_EGD: torch.Tensor, *, w_up_EDG: torch.Tensor | None = None,
                    activation: str = "relu", impl: str = "auto", dropout: float = 0.0,
                    training: bool = False) -> torch.Tensor:
    """y[m] = Σ_{e: gates[m, e] ≠ 0} gates[m, e] · expert_e(x[m]), [M, D], a variable number of
    experts per row (module docstring). Under torch.compile the registered op (hidden dropout
    is not supported there: it would need the op to carry the random state)."""
    if gates_ME.dim() != 2 or gates_ME.shape != (x_MD.shape[0], w1_EDG.shape[0]):
        raise ValueError(f"gates must be [M, E] = [{x_MD.shape[0]}, {w1_EDG.shape[0]}] (rows "
                         f"of x, experts of w1), got {tuple(gates_ME.shape)}")
    if torch.compiler.is_compiling():
        if training and dropout > 0:
            raise ValueError("hidden dropout inside the compiled variable-k expert MLP is not "
                             "supported; set the layer's dropout to 0 or run it eagerly")
        x_MD, w1_EDG, w2_EGD, w_up_EDG = autocast_cast(x_MD, w1_EDG, w2_EGD, w_up_EDG)
        return mask_expert_mlp_op(x_MD, gates_ME, w1_EDG, w2_EGD, w_up_EDG, activation, impl)
    return _mask_mlp_eager(x_MD, gates_ME, w1_EDG, w2_EGD, w_up_EDG, activation, impl,
                           dropout, training)


@torch.library.custom_op("moeify::mask_expert_mlp", mutates_args=())
def mask_expert_mlp_op(x: Tensor, gates: Tensor, w1: Tensor, w2: Tensor, w_up: Optional[Tensor],
                       activation: str, impl: str) -> Tensor:
    """``mask_expert_mlp`` as one op for torch.compile (module docstring)."""
    with torch.no_grad():
        return _mask_mlp_eager(x, gates, w1, w2, w_up, activation, impl, 0.0, False)


@mask_expert_mlp_op.register_fake
def _(x, gates, w1, w2, w_up, activation, impl):
    return x.new_empty(x.shape)


@torch.library.custom_op("moeify::mask_expert_mlp_backward", mutates_args=())
def mask_expert_mlp_bwd(grad: Tensor, x: Tensor, gates: Tensor, w1: Tensor, w2: Tensor,
                        w_up: Optional[Tensor], activation: str,
                        impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients (x, gates, w1, w2, w_up; w_up's empty when absent): the forward recomputed
    eagerly and differentiated (activation recomputation: nothing routing-sized is saved). A
    registered op runs below the autograd dispatch keys of its thread, so the recomputation
    runs in a worker thread, whose dispatch state is the default one."""
    def run():
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (x, gates, w1, w2)]
            up = None if w_up is None else w_up.detach().requires_grad_()
            y = _mask_mlp_eager(*leaves, up, activation, impl, 0.0, False)
            inputs = leaves + ([up] if up is not None else [])
            grads = torch.autograd.grad(y, inputs, grad, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]

    with ThreadPoolExecutor(max_workers=1) as pool:
        grads = pool.submit(run).result()
    if w_up is None:
        grads.append(x.new_empty(0))
    return tuple(grads)


@mask_expert_mlp_bwd.register_fake
def _(grad, x, gates, w1, w2, w_up, activation, impl):
    return (x.new_empty(x.shape), gates.new_empty(gates.shape), w1.new_empty(w1.shape),
            w2.new_empty(w2.shape), w_up.new_empty(w_up.shape) if w_up is not None
            else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, gates, w1, w2, w_up, activation, impl = inputs
    ctx.save_for_backward(x, gates, w1, w2, w_up)
    ctx.meta = (activation, impl)


def _backward(ctx, grad):
    x, gates, w1, w2, w_up = ctx.saved_tensors
    gx, gg, g1, g2, gu = mask_expert_mlp_bwd(grad, x, gates, w1, w2, w_up, *ctx.meta)
    return gx, gg, g1, g2, (gu if w_up is not None else None), None, None


mask_expert_mlp_op.register_autograd(_backward, setup_context=_setup_context)


__all__ = ["ACTIVATIONS", "mask_expert_mlp", "mask_pairs", "pair_expert_mlp"]
