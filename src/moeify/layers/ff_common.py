"""What the feedforward layers share: the hidden activations, and the router statistics every MoE
feedforward reports besides its RoutingStats record.

Activations: "relu" (the papers' MoE experts and dense baseline), "gelu_tanh" (GPT-2's gelu_new:
the tanh approximation of GELU), "gelu" (exact erf), "silu" (Swish with beta 1, SwiGLU's).

Shape legend: M tokens (rows), E experts (router outputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeify.ops.aux_losses import router_entropy

ACTIVATIONS = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def expert_activation(name: str):
    """The ``activation`` argument of moeify.ops.moe.expert_mlp: None for ReLU (its fused path),
    else the function."""
    return None if name == "relu" else ACTIVATIONS[name]


def check_activation(cfg) -> None:
    """A one-line error unless ``cfg.activation`` names one of ACTIVATIONS."""
    if cfg.activation not in ACTIVATIONS:
        raise ValueError(f"{type(cfg).__name__}.activation must be one of "
                         f"{', '.join(ACTIVATIONS)}, got {cfg.activation!r}")


@torch.no_grad()
def routing_stats(counts_E: torch.Tensor, probs_ME: torch.Tensor, valid_M: torch.Tensor | None,
                  n_real: int | None = None) -> dict[str, torch.Tensor]:
    """router_entropy (mean per-token entropy of ``probs_ME``) and dead_experts (how many of the
    first ``n_real`` experts got no token in this batch), detached and cheap."""
    n_real = counts_E.shape[0] if n_real is None else n_real
    return {
        "router_entropy": router_entropy(probs_ME.detach(), valid_M),
        "dead_experts": (counts_E[:n_real] == 0).sum(),
    }
