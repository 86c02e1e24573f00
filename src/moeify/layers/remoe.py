"""ReMoE feedforward (Wang, Zhu, Chen, ICLR 2025, arXiv 2412.14711, "ReMoE: Fully Differentiable
Mixture-of-Experts with ReLU Routing"): ReLU routing with adaptive L1 sparsity control, so each
token uses a variable number of experts.

Per token x (Sec. 3, ReLU routing):

    R(x) = ReLU(x · W_rᵀ)                               [E], float32 (float64 for float64 input)
    y    = Σ_{e: R(x)_e > 0} R(x)_e · expert_e(x)       any number of experts, none included

``expert_e`` is the authors' SwiGLU MLP (their LLaMA runs, ``--swiglu``):
(SiLU(x · W_gate,e) ⊙ x · W_in,e) · W_out,e; ``gated=False`` gives the two-layer ReLU (or
``activation``) expert of sigma-MoE. The experts are the shared routed-experts module
(``self.experts``, moeify.layers.experts.RoutedExperts, state-dict keys ``experts.*``); the
routed pairs are the nonzeros of R, run by its ``forward_variable_k`` (the variable-k expert
MLP, moeify.ops.moe.pairs): no row is padded to a fixed k. Expert parallelism
(moeify.train.expert_parallel) shards that module and moves the pairs as for any other layer.

Sparsity control (Sec. 3, adaptive L1 regularisation with load balancing). The loss adds
lambda · L_reg, returned as the aux loss "l1":

    L_reg = Σ_e f_e · (1/T) Σ_t R(x_t)_e,   f_e = E / (k · T) · #{t : R(x_t)_e > 0}

(T the valid tokens, f_e a count without gradient; the authors compute it with Megatron's
switch-balancing formula, ``switch_load_balancing_loss_func(probs, tokens_per_expert, topk,
lambda)``). lambda lives in the float32 buffer ``l1_coef`` (saved with the model) and is
updated once per optimizer step toward the target sparsity 1 - k/E:

    lambda <- lambda · alpha   if S < 1 - k/E,   else lambda / alpha

S being the fraction of zero routing outputs over the update's tokens and every ReMoE layer
(the authors average it over layers, micro-batches and data-parallel ranks). The update runs on
the device, no host sync: ``update_l1_coef`` takes S as a tensor; the trainer computes S from
the routing records the forward returns (moeify.train.balancing), so activation recomputation
never counts a token twice. Those records count E + 1 columns: the experts, then the
(token, expert) pairs not routed (``n_real = E``), so S = counts[E] / counts.sum().

Weight mapping to the authors' Megatron module (``ReLURouter`` + ``GroupedMLP``/
``SequentialMLP`` with ``--swiglu``): ``w_router`` [E, D] is ``router.weight``; expert e's
``linear_fc1.weight`` [2G, D] is [``experts.w_gate[e]ᵀ``; ``experts.w_in[e]ᵀ``] (Megatron's
SwiGLU chunks fc1's output into the SiLU half, then the linear half); ``linear_fc2.weight``
[D, G] is ``experts.w_out[e]ᵀ``. Init as theirs: N(0, init_std²) for the router and fc1,
N(0, init_std² / (2L)) for fc2 (Megatron's scaled output init), init_std = 0.01 in their
scripts.

Deviations, documented: the authors' router jitter (``moe_input_jitter_eps``, off in their
scripts) is not implemented; the L1 term is computed in evaluation too (the authors only add it
in training; it does not change the LM loss that evaluation reports); the coefficient update
uses the sparsity of the tokens of the update rather than a mean of per-micro-batch ratios
(equal for equal micro-batches without padding).

Shape legend: B batch, T tokens, M = B·T rows, D d_model, E experts, G expert hidden width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeify.layers.common import (
    Aux,
    accumulate_usage,
    check_expert_impl,
    check_flag,
    check_positive,
    check_probability,
    check_token_input,
    register_usage,
    routing_record,
)
from moeify.layers.experts import RoutedExperts
from moeify.layers.ff_common import check_activation
from moeify.ops.routing import router_logits


@dataclass(frozen=True, kw_only=True)
class ReMoEConfig:
    """ReMoE feedforward (module docstring).

    k:              the target number of active experts per token: the target sparsity is
                    1 - k / E (the authors' ``moe_router_topk``); the routing itself has no k.
    expert_size:    G, each expert's hidden width (the authors' ``moe_ffn_hidden_size``).
    gated:          SwiGLU experts (the authors'); False: act(x W_in) W_out.
    activation:     the experts' activation ("silu" with gated, "relu" for sigma-MoE's form).
    l1_coef_init:   lambda_0 (the authors' ``moe_relu_l1_reg_coeff_init``, 1e-8).
    l1_multiplier:  alpha of the update (``moe_relu_l1_reg_coeff_multiplier``, 1.2).
    init_std:       the std of the router and input weights (``--init-method-std``, 0.01);
                    the output weights take init_std / sqrt(2 · n_layers).
    dropout:        on the experts' hidden units (0 in the paper)."""

    d_model: int
    n_experts: int
    expert_size: int
    k: float = 1.0
    gated: bool = True
    activation: str = "silu"
    l1_coef_init: float = 1e-8
    l1_multiplier: float = 1.2
    init_std: float = 0.01
    dropout: float = 0.0
    n_layers: int = 1
    expert_impl: str = "auto"

    def __post_init__(self) -> None:
        check_positive(self, "d_model", "n_experts", "expert_size", "n_layers")
        if not (self.init_std > 0 and self.l1_coef_init > 0):
            raise ValueError(f"ReMoEConfig.init_std and l1_coef_init must be positive, got "
                             f"{self.init_std} and {self.l1_coef_init}")
        if not 0 < self.k <= self.n_experts:
            raise ValueError(f"ReMoEConfig.k (the target active experts per token) must lie in "
                             f"(0, n_experts={self.n_experts}], got {self.k}")
        if not self.l1_multiplier > 1:
            raise ValueError(f"ReMoEConfig.l1_multiplier (alpha) must exceed 1, got "
                             f"{self.l1_multiplier}; the paper uses 1.2")
        check_flag(self, "gated")
        check_activation(self)
        check_probability(self, "dropout")
        check_expert_impl(self)

    @property
    def target_sparsity(self) -> float:
        return 1.0 - self.k / self.n_experts

    def build(self) -> "ReMoE":
        return ReMoE(self)


def remoe_l1(route_ME: torch.Tensor, active_ME: torch.Tensor, k: float,
             valid_M: torch.Tensor | None = None) -> torch.Tensor:
    """L_reg = Σ_e f_e · (1/T) Σ_t R_te with f_e = E / (k · T) · (tokens routed to e), over the
    valid tokens (module docstring); f_e carries no gradient."""
    E = route_ME.shape[-1]
    if valid_M is not None:
        route_ME = route_ME * valid_M[:, None].to(route_ME.dtype)
        active_ME = active_ME & valid_M[:, None]
        T = valid_M.sum().clamp_min(1).to(route_ME.dtype)
    else:
        T = torch.tensor(max(route_ME.shape[0], 1), dtype=route_ME.dtype, device=route_ME.device)
    f_E = active_ME.sum(0).to(route_ME.dtype) * (E / k) / T
    return (f_E * route_ME.sum(0)).sum() / T


class ReMoE(nn.Module):
    """Aux losses: "l1" (lambda · L_reg). Routing: ``aux.routing["router"]`` with E + 1 columns
    (the last: pairs not routed; ``n_real = E``). Stats: sparsity (fraction of zero routing
    outputs), experts_per_token (mean active experts), l1_coef (lambda). Buffers: ``l1_coef``
    (float32 [], persistent), ``usage`` [E] (running selection counts, training only)."""

    def __init__(self, config: ReMoEConfig):
        super().__init__()
        self.config = config
        E, D, G = config.n_experts, config.d_model, config.expert_size
        self.w_router = nn.Parameter(torch.empty(E, D))  # [E, D]: the authors' router.weight
        self.experts = RoutedExperts(E, D, G, gated=config.gated, activation=config.activation,
                                     dropout=config.dropout, impl=config.expert_impl)
        self.register_buffer("l1_coef", torch.tensor(config.l1_coef_init, dtype=torch.float32))
        register_usage(self, "usage", (E,))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        c, ex = self.config, self.experts
        # The authors' fc1 (SiLU half, then linear half), then fc2 (module docstring).
        for w in (self.w_router,) + ((ex.w_gate, ex.w_in) if c.gated else (ex.w_in,)):
            nn.init.normal_(w, std=c.init_std)
        nn.init.normal_(ex.w_out, std=c.init_std / (2 * c.n_layers) ** 0.5)
        self.l1_coef.fill_(c.l1_coef_init)

    def _apply(self, fn, recurse=True):
        # lambda stays float32 under model.to(dtype) / .half() (the authors override half() and
        # bfloat16() for this buffer): 1e-8 · 1.2^n needs the float32 mantissa.
        coef = self.l1_coef
        out = super()._apply(fn, recurse)
        if self.l1_coef.dtype != torch.float32:
            self.l1_coef = self.l1_coef.to(torch.float32)
        del coef
        return out

    @torch.no_grad()
    def update_l1_coef(self, sparsity: torch.Tensor) -> None:
        """lambda <- lambda · alpha if ``sparsity`` < 1 - k/E, else lambda / alpha (module
        docstring), on the device (``sparsity`` a tensor: no host sync)."""
        c = self.config
        s = torch.as_tensor(sparsity, device=self.l1_coef.device)
        up = torch.tensor(c.l1_multiplier, dtype=torch.float32, device=self.l1_coef.device)
        self.l1_coef.mul_(torch.where(s < c.target_sparsity, up, 1 / up))

    def route(self, x_MD: torch.Tensor) -> torch.Tensor:
        """R(x) = ReLU(x W_rᵀ), [M, E]: float32 (float64 for float64 input)."""
        if x_MD.dtype == torch.float64:
            return torch.relu(F.linear(x_MD, self.w_router.to(torch.float64)))
        return torch.relu(router_logits(x_MD, self.w_router))

    def forward(self, x_BTD: torch.Tensor, *,
                valid_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, Aux]:
        c = self.config
        check_token_input("ReMoE", x_BTD, c.d_model, valid_BT)
        B, T, D = x_BTD.shape
        E = c.n_experts
        x_MD = x_BTD.reshape(B * T, D)
        valid_M = None if valid_BT is None else valid_BT.reshape(B * T)
        route_ME = self.route(x_MD)
        if valid_M is not None:  # padding routes nowhere: no expert runs for it
            route_ME = route_ME * valid_M[:, None].to(route_ME.dtype)
        active_ME = route_ME > 0
        y_MD = self.experts.forward_variable_k(x_MD, route_ME)
        aux = Aux()
        aux.losses["l1"] = self.l1_coef.to(route_ME.dtype) * remoe_l1(route_ME, active_ME, c.k,
                                                                      valid_M)
        # The routing record: the experts, then one column counting the pairs not routed.
        ids_ME = torch.where(active_ME, torch.arange(E, device=x_MD.device), E)
        keep = None if valid_M is None else valid_M[:, None]
        record = routing_record("remoe", ids_ME, E + 1, route_ME, keep, n_real=E)
        aux.routing["router"] = record
        with torch.no_grad():
            n_valid = (active_ME.new_tensor(float(B * T), dtype=torch.float32)
                       if valid_M is None else valid_M.sum().float())
            per_token = active_ME.sum().float() / n_valid.clamp_min(1)
            aux.stats["experts_per_token"] = per_token
            aux.stats["sparsity"] = 1 - per_token / E
            aux.stats["l1_coef"] = self.l1_coef.detach().clone()
        if self.training:
            accumulate_usage(self, "usage", record.counts[0, :E])
        return y_MD.view(B, T, D).to(x_BTD.dtype), aux


__all__ = ["ReMoE", "ReMoEConfig", "remoe_l1"]
