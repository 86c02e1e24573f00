"""The routing statistics every MoE feedforward reports.

Shape legend: M tokens (rows), K experts per token, E experts (router outputs).
"""

from __future__ import annotations

import torch

from moeify.ops.aux_losses import router_entropy


@torch.no_grad()
def expert_counts(idx_MK: torch.Tensor, num_experts: int,
                  keep_MK: torch.Tensor | None = None) -> torch.Tensor:
    """Routed (row, expert) pairs per expert, int64 [E]; pairs with keep False (padding, dropped
    tokens) are not counted. One bincount, no host sync."""
    flat = idx_MK.reshape(-1).long()
    if keep_MK is not None:
        flat = torch.where(keep_MK.reshape(-1), flat, num_experts)  # park past the end
    return torch.bincount(flat, minlength=num_experts + 1)[:num_experts]


@torch.no_grad()
def routing_stats(counts_E: torch.Tensor, probs_ME: torch.Tensor, valid_M: torch.Tensor | None,
                  n_real: int | None = None) -> dict[str, torch.Tensor]:
    """The statistics every MoE feedforward reports (detached, cheap):
    tokens_per_expert [E], router_entropy (mean per-token entropy of ``probs_ME``), and
    dead_experts (how many of the first ``n_real`` experts got no token in this batch)."""
    n_real = counts_E.shape[0] if n_real is None else n_real
    return {
        "tokens_per_expert": counts_E,
        "router_entropy": router_entropy(probs_ME.detach(), valid_M),
        "dead_experts": (counts_E[:n_real] == 0).sum(),
    }
