"""The router statistics every MoE feedforward reports besides its RoutingStats record.

Shape legend: M tokens (rows), E experts (router outputs).
"""

from __future__ import annotations

import torch

from moeify.ops.aux_losses import router_entropy


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
