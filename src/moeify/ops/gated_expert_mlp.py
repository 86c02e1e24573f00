"""The gated (SwiGLU) expert MLP of Mixtral, Qwen-MoE and OLMoE, on the shared expert matmul.

Shape legend
    M  rows (tokens)     K  experts per row      E  experts       N = M * K routed pairs
    D  model width       G  expert hidden width

    y[m] = Σ_k gates[m, k] · (act(x[m] @ w_gate[e]) ⊙ (x[m] @ w_up[e])) @ w_down[e],  e = idx[m, k]

(Shazeer 2020, Eq. 6, per expert; Hugging Face's ``MixtralExperts`` computes the same sum with
one loop over the experts it stores as ``gate_up_proj`` [E, 2G, D] and ``down_proj`` [E, D, G].)
Written as three ``expert_matmul`` calls that share one plan (one sort of the pairs), so every
implementation of the expert matmul, its reference and its gradients, serves the gated expert
too; the activation runs on the [N, G] hidden units between them. This is the composite form of
``moeify.ops.expert_mlp`` with a gate; a fused kernel would be a later optimisation with this
function as its reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeify.ops.expert_matmul import PLANLESS, ExpertPlan, expert_matmul, make_plan


def gated_expert_mlp(x_MD: torch.Tensor, idx_MK: torch.Tensor, w_gate_EDG: torch.Tensor,
                     w_up_EDG: torch.Tensor, w_down_EGD: torch.Tensor, gates_MK: torch.Tensor,
                     *, activation=F.silu, impl: str = "auto", plan: ExpertPlan | None = None,
                     dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """y[m] = Σ_k gates[m, k] · Drop(act(x[m] @ w_gate[e]) ⊙ x[m] @ w_up[e]) @ w_down[e]: [M, D]
    (module docstring). ``activation`` is elementwise (SiLU for SwiGLU); ``dropout`` acts on the
    hidden units when ``training``."""
    if w_gate_EDG.shape != w_up_EDG.shape:
        raise ValueError(f"w_gate and w_up must have one shape [E, D, G], got "
                         f"{list(w_gate_EDG.shape)} and {list(w_up_EDG.shape)}")
    E, G = w_gate_EDG.shape[0], w_gate_EDG.shape[2]
    want = (E, G, w_gate_EDG.shape[1])
    if tuple(w_down_EGD.shape) != want:
        raise ValueError(f"w_down must be [E, G, D] = {list(want)}, got {list(w_down_EGD.shape)}")
    M, K = idx_MK.shape
    if plan is None and impl not in PLANLESS:
        plan = make_plan(idx_MK, E)
    g_MKG = expert_matmul(x_MD, idx_MK, w_gate_EDG, impl=impl, plan=plan)
    u_MKG = expert_matmul(x_MD, idx_MK, w_up_EDG, impl=impl, plan=plan)
    h_NG = F.dropout(activation(g_MKG) * u_MKG, dropout, training).reshape(M * K, G)
    return expert_matmul(h_NG, idx_MK.reshape(M * K, 1), w_down_EGD,
                         gates_MK.reshape(M * K, 1).to(h_NG.dtype), sum_rows=K, impl=impl,
                         plan=plan)


__all__ = ["gated_expert_mlp"]
