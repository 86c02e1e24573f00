"""Feedforward layers: the dense ReLU MLP of the papers' baselines, and (re-exported here) the two
expert feedforwards, sigma-MoE (``sigma_moe.py``) and Switch (``switch_ff.py``).

Every feedforward has the interface of docs/interfaces.md:

    y_BTD, aux = feedforward(x_BTD, *, valid_BT=None)

``valid_BT`` marks real tokens; padding is excluded from aux losses and statistics. The
feedforward applies its own inner dropout; the block applies the residual dropout.

Shape legend: B batch, T tokens, D d_model, F hidden width (d_ff).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeify.ops.dropout import relu_dropout

from moeify.layers.common import (
    Aux,
    check_positive,
    check_probability,
    check_token_input,
    init_scale,
    trunc_normal_exact_std_,
)


@dataclass(frozen=True, kw_only=True)
class DenseFFConfig:
    """The paper baseline's MLP (SwitchHead appendix): W2 · Drop(ReLU(W1 · x + b1)) + b2.

    n_layers: model depth L, for the initialisation std sqrt(2 / (L · fan_in)).
    dropout:  on the hidden activations (0.1 small / 0.2 big models in the paper)."""

    d_model: int
    d_ff: int
    dropout: float = 0.0
    n_layers: int = 1

    def __post_init__(self) -> None:
        check_positive(self, "d_model", "d_ff", "n_layers")
        check_probability(self, "dropout")

    def build(self) -> "DenseFeedForward":
        return DenseFeedForward(self)


class DenseFeedForward(nn.Module):
    # "reference": ReLU then torch's dropout (keeping both for backward), as the tests compare
    dropout_impl: str = "auto"

    def __init__(self, config: DenseFFConfig):
        super().__init__()
        self.config = config
        self.w1 = nn.Linear(config.d_model, config.d_ff)
        self.w2 = nn.Linear(config.d_ff, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # SwitchHead appendix: dense baseline Linears trunc-normal, std sqrt(2 / (L · fan_in)),
        # rescaled to exactly that std as the authors' code does.
        s = init_scale(self.config.n_layers)
        for lin in (self.w1, self.w2):
            trunc_normal_exact_std_(lin.weight, s / lin.in_features ** 0.5)
            nn.init.zeros_(lin.bias)

    def forward(self, x_BTD: torch.Tensor, *,
                valid_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, Aux]:
        check_token_input("DenseFeedForward", x_BTD, self.config.d_model, valid_BT)
        # = self.drop(F.relu(self.w1(x_BTD))), keeping only h for backward (w2 keeps it anyway)
        h_BTF = relu_dropout(self.w1(x_BTD), self.drop.p, self.training,
                             impl=self.dropout_impl)
        return self.w2(h_BTF), Aux()


# The expert feedforwards live in their own files; importing them here keeps the one entry point
# that docs/interfaces.md names (they do not import this module, so there is no cycle).
from moeify.layers.sigma_moe import SigmaMoE, SigmaMoEConfig  # noqa: E402
from moeify.layers.switch_ff import SwitchFeedForward, SwitchFFConfig  # noqa: E402

__all__ = ["DenseFFConfig", "DenseFeedForward", "SigmaMoEConfig", "SigmaMoE",
           "SwitchFFConfig", "SwitchFeedForward"]
