"""Routed experts: E two-layer MLPs with stacked weights, run on the (token, expert) pairs a
router chose. One module for every feedforward MoE that sends tokens to expert MLPs (sigma-MoE,
Switch and the Hugging Face MoE families built on it); the router, capacity and aux losses stay
in the owning layer, which calls

    y_MD = experts(x_MD, ids_MK, gates_MK, keep_MK, rows=P)

    y[m] = sum over k with keep[m, k] of  gates[m, k] · expert_{ids[m, k]}(x[m])
    expert_e(x) = Drop(act(x · w_in[e] + bias_in[e])) · w_out[e]                plain
    expert_e(x) = Drop(act(x · w_gate[e]) ⊙ (x · w_in[e])) · w_out[e]          gated (SwiGLU,
                                                                             Shazeer 2020, Eq. 6)

Weights are stacked with the expert first, ``w_in`` / ``w_gate`` [E, D, G], ``w_out`` [E, G, D],
``bias_in`` [E, G] (moeify.layers.common: the naming convention), as in torchtitan's
GroupedExperts and Hugging Face's fused experts. Every parameter of this module has the expert
on dim 0, so a parallelism can shard the module by its parameters alone: expert parallelism
(moeify.train.expert_parallel) turns them into ``Shard(0)`` DTensors and replaces the token
movement around ``run``, from outside, as torchtitan applies its ExpertParallel style to
``moe.experts``; the owning layers know nothing of it.

``rows=P`` (capacity routing): the kept pairs are packed into a static buffer of P rows (a stable
sort puts them first, in pair order; the rows past the kept ones go to expert 0 with gate 0 and
are dropped after), so the expert matmuls never see more rows than the capacity allows and no
host sync is needed. Without ``rows`` every pair is computed where it is, a pair not kept with
expert 0 and gate 0 (static shapes).

Shape legend: M tokens, K choices per token, N = M·K pairs, P packed pairs, D d_model, G expert
hidden width, E experts.
"""

from __future__ import annotations

import torch
from torch import nn

from moeify.layers.ff_common import ACTIVATIONS, expert_activation
from moeify.ops.moe import expert_mlp, gated_expert_mlp, make_plan


# The state-dict keys of the expert weights relative to their layer when the layer held them
# itself, before this module (checkpoints of those runs load: the layers map them on loading,
# moeify.layers.common.rename_legacy_keys).
EXPERT_KEYS = {"w_in": "experts.w_in", "w_out": "experts.w_out", "w_gate": "experts.w_gate",
               "bias_in": "experts.bias_in"}


class RoutedExperts(nn.Module):
    """E expert MLPs of hidden width G (module docstring). The owning layer initialises the
    weights (each paper has its recipe); ``bias_in`` starts at zero."""

    def __init__(self, n_experts: int, d_model: int, d_hidden: int, *, gated: bool = False,
                 bias: bool = False, activation: str = "relu", dropout: float = 0.0,
                 impl: str = "auto") -> None:
        super().__init__()
        if gated and bias:
            raise ValueError("RoutedExperts: gated experts have no biases; set bias=False")
        E, D, G = n_experts, d_model, d_hidden
        self.n_experts, self.gated, self.activation = E, gated, activation
        self.dropout, self.impl = dropout, impl
        # Registration order: the optimizer's state is saved by parameter index.
        self.w_in = nn.Parameter(torch.empty(E, D, G))  # [E, D, G]
        self.w_out = nn.Parameter(torch.empty(E, G, D))  # [E, G, D]
        if gated:
            self.w_gate = nn.Parameter(torch.empty(E, D, G))  # [E, D, G]
        if bias:
            self.bias_in = nn.Parameter(torch.zeros(E, G))  # [E, G]

    def weights(self) -> dict[str, torch.Tensor]:
        """The stacked expert tensors by name (every parameter of the module, expert first)."""
        return dict(self.named_parameters(recurse=False))

    def forward(self, x_MD: torch.Tensor, ids_MK: torch.Tensor, gates_MK: torch.Tensor,
                keep_MK: torch.Tensor | None = None, *, rows: int | None = None) -> torch.Tensor:
        """Σ_k gates · expert_{ids}(x) over the kept pairs, [M, D] (module docstring)."""
        M, K = ids_MK.shape
        if keep_MK is None:
            return self.run(x_MD, ids_MK, gates_MK)
        if rows is None or rows >= M * K:
            return self.run(x_MD, torch.where(keep_MK, ids_MK, 0),
                            torch.where(keep_MK, gates_MK, 0.0))
        N, P = M * K, rows
        keep_N = keep_MK.reshape(-1)
        sort_N = torch.argsort((~keep_N).to(torch.uint8), stable=True)
        pairs_P = sort_N[:P]
        keep_P = keep_N[pairs_P]
        ids_P1 = torch.where(keep_P, ids_MK.reshape(-1)[pairs_P], 0)[:, None]
        gates_P1 = torch.where(keep_P, gates_MK.reshape(-1)[pairs_P], 0.0)[:, None]
        x_PD = x_MD.index_select(0, torch.div(pairs_P, K, rounding_mode="floor"))
        # Rows past the kept ones have gate 0: their bias never reaches the output.
        y_PD = self.run(x_PD, ids_P1, gates_P1)
        # Back to pair order by a gather (deterministic): pair n sits at packed row pos_N[n].
        pos_N = torch.empty_like(sort_N)
        pos_N[sort_N] = torch.arange(N, device=sort_N.device)
        packed_N = pos_N < P
        y_ND = y_PD.index_select(0, pos_N.clamp_max(P - 1)) * packed_N[:, None].to(y_PD.dtype)
        return y_ND.view(M, K, -1).sum(1)

    def run(self, x_RD: torch.Tensor, ids_RK: torch.Tensor, gates_RK: torch.Tensor,
            weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The experts on rows ``x_RD``: Σ_k gates[r, k] · expert_{ids[r, k]}(x_r), [R, D], with
        every id a valid expert of ``weights`` (default: this module's own; a parallelism passes
        the experts one process holds, E_local of them, ids in [0, E_local))."""
        w = self.weights() if weights is None else weights
        # One plan (one sort of the pairs) serves every expert matmul; moeify.ops.moe.policy
        # decides "auto". It spans the experts the weights hold.
        plan = make_plan(ids_RK, w["w_in"].shape[0])
        if self.gated:
            return gated_expert_mlp(x_RD, ids_RK, w["w_gate"], w["w_in"], w["w_out"], gates_RK,
                                    activation=ACTIVATIONS[self.activation], impl=self.impl,
                                    plan=plan, dropout=self.dropout, training=self.training)
        return expert_mlp(x_RD, ids_RK, w["w_in"], w["w_out"], gates_RK, impl=self.impl,
                          plan=plan, dropout=self.dropout, training=self.training,
                          bias_EG=w.get("bias_in"), activation=expert_activation(self.activation))

    def extra_repr(self) -> str:
        w = self.w_in
        return (f"n_experts={w.shape[0]}, d_model={w.shape[1]}, d_hidden={w.shape[2]}, "
                f"gated={self.gated}, bias={'bias_in' in self._parameters}, "
                f"activation={self.activation!r}")
