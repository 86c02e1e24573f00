"""sigma-MoE feedforward (Csordas, Irie, Schmidhuber, EMNLP 2023 Findings, "Approximating Two-Layer
Feedforward Networks for Efficient Transformers"); the feedforward half of SwitchAll.

A two-layer ReLU MLP of hidden size E·G cut into E experts of G hidden units each. Per token
(the paper's σ-MoE):

    s   = sigmoid(x · W_routerᵀ)                   float32, [E]
    sel = top-k of s                                (indices carry no gradient)
    y   = sum over e in sel of  s_e · ReLU(x · W_in,e) · W_out,e    no biases

(the paper's keys K_e and values V_e are ``experts.w_in`` [E, D, G] and ``experts.w_out``
[E, G, D], moeify.layers.experts; ``w_router`` [E, D] is its W_sel. ``bias`` and ``activation``
generalise the expert to
act(x · W_in,e + b_e) · W_out,e, plus an ungated output bias: the form of a dense MLP with
biases and another activation, for upcycling.)

Regulariser (coefficient gamma = ``entropy_coef``, returned as the aux loss "entropy"): minus the
entropy of the batch-averaged softmax of the selection logits; routing itself stays sigmoid.
``entropy_pool="sequence"`` is MoEUT's form of it (RobertCsordas/moeut, moeut.py,
SigmaMoE.get_reg_loss: ``entropy_reg(stack(sel_hist, -2).flatten(-3, -2), -2)``): the softmax is
averaged per sequence over its tokens and over every application of the (shared) layer, and
minus the entropy is averaged over the sequences; the layer returns its share as
``Aux.pooled["entropy"]`` and the model takes the loss once per block (moeify.models.lm).

Options of later work: ``shared`` (DeepSeekMoE's shared expert isolation: a dense expert every
token goes through, moeify.layers.shared_expert) and ``lossfree_rate`` (loss-free balancing,
arXiv 2408.15664: a buffer ``expert_bias`` [E] added to the sigmoid scores for the top-k choice
only, updated by the trainer after each optimizer step, moeify.train.balancing).

Shape legend: B batch, T tokens, M = B·T rows, D d_model, E experts, G expert size (hidden
units per expert), K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeify.layers.common import (
    Aux,
    PooledEntropy,
    accumulate_usage,
    check_expert_impl,
    check_flag,
    check_nonnegative,
    check_positive,
    check_probability,
    check_token_input,
    init_scale,
    register_usage,
    rename_legacy_keys,
    routing_record,
    renorm_rows_,
)
from moeify.layers.experts import EXPERT_KEYS, RoutedExperts
from moeify.layers.ff_common import check_activation, routing_stats
from moeify.layers.mlp import GatedMLPConfig, MLPConfig
from moeify.layers.shared_expert import add_shared, build_shared, check_shared, reset_shared_gate
from moeify.ops.aux_losses import batch_entropy_loss, sequence_prob_sums
from moeify.ops.routing import router_logits, sigmoid_topk


@dataclass(frozen=True, kw_only=True)
class SigmaMoEConfig:
    """sigma-MoE feedforward. Paper settings (SwitchAll): expert_size G = 128, k = 4,
    n_experts 16 (47M) or 32 (259M); entropy_coef 1e-4 (47M) or 1e-3 (259M); expert_dropout 0
    (47M) or 0.1 (259M).

    expert_dropout: training only; each token's experts are dropped independently before the
                    top-k (their scores set to 0, so they are chosen only if fewer than k remain,
                    and then with gate 0).
    dropout:        dropout on the expert hidden activations (the authors' layer has this
                    option); 0 in every published sigma-MoE run, hence the default.
    n_layers:       model depth L for the init scale s = sqrt(2 / L).
    expert_impl:    the moeify.ops.moe kernel ("auto" picks per device).
    bias:           a hidden bias per expert ``bias_in`` [E, G] and one ungated output bias
                    ``bias_out`` [D] (zero-initialised); the paper's layer has none. A dense MLP
                    with biases needs them to be split exactly into its experts
                    (moeify.models.upcycle).
    activation:     the experts' hidden activation, one of moeify.layers.ff_common.ACTIVATIONS:
                    "relu" is the paper's; "gelu_tanh" / "gelu" / "silu" hold experts split
                    from a dense MLP with that activation (GPT-2's is "gelu_tanh").
    shared:         an MLPConfig or GatedMLPConfig: a shared expert (DeepSeekMoE) added to
                    every token; e.g. MLPConfig(d_model=D, d_ff=n_shared * G, activation="relu",
                    bias=False) for n_shared experts of the routed ones' size. None = none.
    n_shared:       DeepSeekMoE's shared experts: n_shared experts of the routed ones' form and
                    size, always on (instead of ``shared``; moeify.layers.shared_expert).
    shared_gate:    scale the shared expert by σ(w · x) (Qwen2-MoE); DeepSeekMoE has none.
    lossfree_rate:  gamma of loss-free balancing (0 = off; the paper's 1e-3).
    lossfree_centre: subtract the mean from the bias after each update (not the paper's).
    entropy_pool:   what the entropy regulariser averages the selection softmax over: "batch"
                    (the sigma-MoE paper's: all of this call's tokens, one loss per layer
                    application) or "sequence" (MoEUT's: each sequence's tokens over every
                    application of a shared layer, then minus the entropy averaged over the
                    sequences; returned in ``Aux.pooled``)."""

    d_model: int
    n_experts: int
    expert_size: int
    k: int
    entropy_coef: float = 1e-4
    expert_dropout: float = 0.0
    dropout: float = 0.0
    n_layers: int = 1
    expert_impl: str = "auto"
    bias: bool = False
    activation: str = "relu"
    shared: MLPConfig | GatedMLPConfig | None = None
    n_shared: int = 0
    shared_gate: bool = False
    lossfree_rate: float = 0.0
    lossfree_centre: bool = False
    entropy_pool: str = "batch"

    def __post_init__(self) -> None:
        check_positive(self, "d_model", "n_experts", "expert_size", "n_layers")
        if self.entropy_pool not in ("batch", "sequence"):
            raise ValueError(f"SigmaMoEConfig.entropy_pool must be 'batch' (sigma-MoE) or "
                             f"'sequence' (MoEUT), got {self.entropy_pool!r}")
        check_activation(self)
        check_shared(self)
        check_nonnegative(self, "lossfree_rate")
        check_flag(self, "lossfree_centre", "bias")
        if not 1 <= self.k <= self.n_experts:
            raise ValueError(f"SigmaMoEConfig.k must lie in [1, n_experts={self.n_experts}], "
                             f"got {self.k}; lower k or add experts")
        check_nonnegative(self, "entropy_coef")
        check_probability(self, "expert_dropout", "dropout")
        check_expert_impl(self)

    def build(self) -> "SigmaMoE":
        return SigmaMoE(self)


class SigmaMoE(nn.Module):
    """Aux losses: "entropy" (when entropy_coef > 0; in ``Aux.pooled`` with
    entropy_pool="sequence"). Routing: ``aux.routing["router"]`` (valid
    tokens only). Stats: router_entropy (mean per-token entropy of softmax(logits)), batch_entropy (entropy of
    the batch-averaged softmax, what the regulariser maximises), dead_experts. Running selection
    counts: the int64 buffer ``usage`` [E], training only."""

    def __init__(self, config: SigmaMoEConfig):
        super().__init__()
        self.config = config
        E, D, G = config.n_experts, config.d_model, config.expert_size
        self.w_router = nn.Parameter(torch.empty(E, D))  # [E, D]
        if config.bias:
            self.bias_out = nn.Parameter(torch.zeros(D))  # [D]
        # The paper's keys and values: experts.w_in [E, D, G], experts.w_out [E, G, D].
        self.experts = RoutedExperts(E, D, G, bias=config.bias, activation=config.activation,
                                     dropout=config.dropout, impl=config.expert_impl)
        rename_legacy_keys(self, EXPERT_KEYS)
        build_shared(self, config)
        if config.lossfree_rate > 0:  # persistent: a resumed run keeps its balance
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
        register_usage(self, "usage", (E,))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # sigma-MoE's initialisation: keys and selection N(0, s²/d), values N(0, s²/(E·G)),
        # selection rows renormalised to equal norm.
        c = self.config
        s = init_scale(c.n_layers)
        nn.init.normal_(self.experts.w_in, std=s / c.d_model ** 0.5)
        nn.init.normal_(self.w_router, std=s / c.d_model ** 0.5)
        nn.init.normal_(self.experts.w_out, std=s / (c.n_experts * c.expert_size) ** 0.5)
        renorm_rows_(self.w_router)
        if c.bias:
            self.experts.bias_in.zero_()
            self.bias_out.zero_()
        reset_shared_gate(self, c)

    def route(self, x_MD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits_ME float32, gates_MK float32, idx_MK) with expert dropout in training."""
        c = self.config
        logits_ME = router_logits(x_MD, self.w_router)  # float32 even under autocast
        exclude_ME = None
        if self.training and c.expert_dropout > 0:
            exclude_ME = torch.rand_like(logits_ME) < c.expert_dropout
        top = sigmoid_topk(logits_ME, c.k, exclude=exclude_ME,
                           bias=self.expert_bias if c.lossfree_rate > 0 else None)
        gates_MK = top.gates
        if exclude_ME is not None:
            # A dropped expert's score is 0 (sigma-MoE's expert dropout): picked only when
            # fewer than k survive.
            gates_MK = gates_MK.masked_fill(exclude_ME.gather(-1, top.idx), 0.0)
        return logits_ME, gates_MK, top.idx

    def forward(self, x_BTD: torch.Tensor, *, valid_BT: torch.Tensor | None = None,
                router_BTD: torch.Tensor | None = None) -> tuple[torch.Tensor, Aux]:
        """``router_BTD``: the selection's input when it is not the experts' (MoEUT's
        peri-layernorm routes on LN(x) and runs the experts on x; layers/moeut.py)."""
        c = self.config
        check_token_input("SigmaMoE", x_BTD, c.d_model, valid_BT)
        if router_BTD is not None and router_BTD.shape != x_BTD.shape:
            raise ValueError(f"router_BTD must have the shape of x_BTD {tuple(x_BTD.shape)}, "
                             f"got {tuple(router_BTD.shape)}")
        B, T, D = x_BTD.shape
        x_MD = x_BTD.reshape(B * T, D)
        valid_M = None if valid_BT is None else valid_BT.reshape(B * T)
        logits_ME, gates_MK, idx_MK = self.route(
            x_MD if router_BTD is None else router_BTD.reshape(B * T, D))
        M, K = idx_MK.shape

        # Every pair is computed, padding included (its output is never read); the gate
        # multiplies inside the experts' matmul.
        y_MD = self.experts(x_MD, idx_MK, gates_MK)
        y_BTD = y_MD.view(B, T, D)
        if c.bias:
            y_BTD = y_BTD + self.bias_out.to(y_BTD.dtype)
        y_BTD = add_shared(self, c, y_BTD, x_BTD, valid_BT)

        aux = Aux()
        if c.entropy_coef != 0 and c.entropy_pool == "sequence":
            aux.pooled["entropy"] = PooledEntropy(
                c.entropy_coef, *sequence_prob_sums(logits_ME.reshape(B, T, -1), valid_BT))
        elif c.entropy_coef != 0:
            aux.losses["entropy"] = c.entropy_coef * batch_entropy_loss(logits_ME, valid_M)
        keep_MK = None if valid_M is None else valid_M[:, None].expand(M, K)
        record = routing_record("sigma_moe", idx_MK, c.n_experts, gates_MK, keep_MK)
        counts_E = record.counts[0]
        aux.routing["router"] = record
        aux.stats.update(routing_stats(counts_E, torch.softmax(logits_ME.detach(), -1), valid_M))
        with torch.no_grad():
            aux.stats["batch_entropy"] = -batch_entropy_loss(logits_ME.detach(), valid_M)
        accumulate_usage(self, "usage", counts_E)
        return y_BTD, aux
