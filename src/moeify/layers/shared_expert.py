"""Shared experts of the feedforward MoEs: a dense MLP every token goes through, its output
added to the routed experts'. DeepSeekMoE (Dai et al. 2024, §3.2 "shared expert isolation")
adds it ungated; Qwen2-MoE scales it by a learned scalar sigmoid gate per token, σ(w · x).

    y = routed(x) + shared(x)              gate off (DeepSeekMoE)
    y = routed(x) + σ(w · x) · shared(x)   gate on  (Qwen2-MoE, ``shared_gate.weight`` [1, D])

``n_shared = S`` (DeepSeekMoE's S shared experts of the routed experts' size; together they are
one dense MLP of S times the expert width) builds it from the layer's own expert form: an
MLPConfig of hidden width S · G (sigma-MoE's expert_size, Switch's d_ff) with the experts'
activation and biases, or a GatedMLPConfig when Switch's experts are gated. Otherwise the shared
expert is given whole: an MLPConfig (plain: act(W1 x + b1) W2, e.g. a sigma-MoE-sized ReLU expert of
hidden width n_shared · G) or a GatedMLPConfig (SwiGLU, as DeepSeekMoE and Qwen2-MoE). Its
parameters are counted like any other by moeify.models.cost (part "feedforward").

Shape legend: B batch, T tokens, D d_model.
"""

from __future__ import annotations

import torch
from torch import nn

from moeify.layers.common import check_count, check_flag, trunc_normal_
from moeify.layers.mlp import GatedMLPConfig, MLPConfig


def shared_config(cfg) -> MLPConfig | GatedMLPConfig | None:
    """The shared expert of a layer config: ``cfg.shared``, or the one ``cfg.n_shared`` asks."""
    if cfg.shared is not None or not cfg.n_shared:
        return cfg.shared
    width = cfg.n_shared * getattr(cfg, "expert_size", getattr(cfg, "d_ff", 0))
    if getattr(cfg, "gated", False):
        return GatedMLPConfig(d_model=cfg.d_model, d_ff=width, activation=cfg.activation,
                              n_layers=getattr(cfg, "n_layers", 1))
    return MLPConfig(d_model=cfg.d_model, d_ff=width, activation=cfg.activation, bias=cfg.bias,
                     n_layers=getattr(cfg, "n_layers", 1))


def check_shared(cfg) -> None:
    """``cfg.shared`` must be None or an (Gated)MLPConfig of the layer's d_model, ``n_shared``
    a count >= 0 and not both; shared_gate needs a shared expert."""
    name = type(cfg).__name__
    check_count(cfg, "n_shared")
    if cfg.n_shared and cfg.shared is not None:
        raise ValueError(f"{name}: give either n_shared or shared, not both")
    check_flag(cfg, "shared_gate")
    if cfg.shared is not None and (not isinstance(cfg.shared, (GatedMLPConfig, MLPConfig))
                                   or cfg.shared.d_model != cfg.d_model):
        raise ValueError(f"{name}.shared must be an MLPConfig or GatedMLPConfig with d_model="
                         f"{cfg.d_model} (or None), got {cfg.shared!r}")
    if cfg.shared_gate and shared_config(cfg) is None:
        raise ValueError(f"{name}: shared_gate=True needs a shared expert (shared=)")


def build_shared(layer: nn.Module, cfg) -> None:
    """Give ``layer`` its ``shared`` module (and ``shared_gate`` Linear) when ``cfg`` asks."""
    shared = shared_config(cfg)
    if shared is not None:
        layer.shared = shared.build()
        if cfg.shared_gate:
            layer.shared_gate = nn.Linear(cfg.d_model, 1, bias=False)


@torch.no_grad()
def reset_shared_gate(layer: nn.Module, cfg) -> None:
    if cfg.shared_gate:
        trunc_normal_(layer.shared_gate.weight, (0.1 / cfg.d_model) ** 0.5)


def add_shared(layer: nn.Module, cfg, y_BTD: torch.Tensor, x_BTD: torch.Tensor,
               valid_BT: torch.Tensor | None) -> torch.Tensor:
    """``y_BTD`` plus the shared expert's (gated) output on ``x_BTD``; ``y_BTD`` without one."""
    if not hasattr(layer, "shared"):
        return y_BTD
    s_BTD, _ = layer.shared(x_BTD, valid_BT=valid_BT)
    if cfg.shared_gate:
        s_BTD = torch.sigmoid(layer.shared_gate(x_BTD)) * s_BTD
    return y_BTD + s_BTD
