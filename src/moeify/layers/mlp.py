"""The dense MLPs of the Hugging Face families moeify imports: a plain two-layer MLP with a chosen
activation (GPT-2) and the gated SwiGLU MLP (Llama, Mistral, Qwen2).

    MLP:    W2 · Drop(act(W1 · x + b1)) + b2                     GPT-2 (Radford et al. 2019)
    Gated:  W_down · Drop(act(W_gate · x) ⊙ (W_up · x))           SwiGLU (Shazeer 2020, Eq. 6)

Activations: moeify.layers.ff_common.ACTIVATIONS ("gelu_tanh", GPT-2's gelu_new; "gelu";
"relu"; "silu", SwiGLU's). Both layers have the feedforward interface of
docs/interfaces.md: ``y_BTD, aux = ff(x_BTD, *, valid_BT=None)``; nothing is routed, so the Aux
is empty. Weights are nn.Linear ([out, in]); initialisation as the dense baseline (trunc-normal,
std sqrt(2 / (L · fan_in)), SwitchHead appendix), biases zero.

Shape legend: B batch, T tokens, D d_model, F hidden width (d_ff).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeify.layers.common import (Aux, check_positive, check_probability, check_token_input,
                                  init_scale, trunc_normal_)
from moeify.layers.ff_common import ACTIVATIONS, check_activation


def _check(cfg) -> None:
    check_positive(cfg, "d_model", "d_ff", "n_layers")
    check_probability(cfg, "dropout")
    check_activation(cfg)


def _init(layer: nn.Module, n_layers: int) -> None:
    s = init_scale(n_layers)
    for lin in layer.modules():
        if isinstance(lin, nn.Linear):
            trunc_normal_(lin.weight, s / lin.in_features ** 0.5)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """W2 · act(W1 · x + b1) + b2; ``bias`` adds b1 and b2."""

    d_model: int
    d_ff: int
    activation: str = "gelu_tanh"
    bias: bool = True
    dropout: float = 0.0
    n_layers: int = 1

    def __post_init__(self) -> None:
        _check(self)

    def build(self) -> "MLP":
        return MLP(self)


class MLP(nn.Module):
    def __init__(self, config: MLPConfig):
        super().__init__()
        self.config = c = config
        self.w1 = nn.Linear(c.d_model, c.d_ff, bias=c.bias)
        self.w2 = nn.Linear(c.d_ff, c.d_model, bias=c.bias)
        self.drop = nn.Dropout(c.dropout)
        _init(self, c.n_layers)

    def forward(self, x_BTD: torch.Tensor, *,
                valid_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, Aux]:
        check_token_input("MLP", x_BTD, self.config.d_model, valid_BT)
        h_BTF = self.drop(ACTIVATIONS[self.config.activation](self.w1(x_BTD)))
        return self.w2(h_BTF), Aux()


@dataclass(frozen=True, kw_only=True)
class GatedMLPConfig:
    """W_down · (act(W_gate · x) ⊙ W_up · x); ``bias`` adds a bias to all three projections."""

    d_model: int
    d_ff: int
    activation: str = "silu"
    bias: bool = False
    dropout: float = 0.0
    n_layers: int = 1

    def __post_init__(self) -> None:
        _check(self)

    def build(self) -> "GatedMLP":
        return GatedMLP(self)


class GatedMLP(nn.Module):
    def __init__(self, config: GatedMLPConfig):
        super().__init__()
        self.config = c = config
        self.w_gate = nn.Linear(c.d_model, c.d_ff, bias=c.bias)
        self.w_up = nn.Linear(c.d_model, c.d_ff, bias=c.bias)
        self.w_down = nn.Linear(c.d_ff, c.d_model, bias=c.bias)
        self.drop = nn.Dropout(c.dropout)
        _init(self, c.n_layers)

    def forward(self, x_BTD: torch.Tensor, *,
                valid_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, Aux]:
        check_token_input("GatedMLP", x_BTD, self.config.d_model, valid_BT)
        act = ACTIVATIONS[self.config.activation]
        h_BTF = self.drop(act(self.w_gate(x_BTD)) * self.w_up(x_BTD))
        return self.w_down(h_BTF), Aux()


__all__ = ["ACTIVATIONS", "MLPConfig", "MLP", "GatedMLPConfig", "GatedMLP"]
