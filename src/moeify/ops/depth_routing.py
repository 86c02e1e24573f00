"""Token-level routing in depth (Mixture-of-Depths, Raposo et al. 2024): gather the routed tokens
of each sequence, write their updated states back, and the binary losses that teach a causal rule
which tokens the (non-causal) sequence top-k would have chosen.

Shape legend: B batch, T tokens per sequence, C routed tokens per sequence, D d_model.

The selection itself is ``moeify.ops.routing.expert_choice`` (ascending positions, ceil capacity).
Everything here is gather / scatter with unique indices: deterministic, no atomics, no host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeify.ops.aux_losses import masked_mean


def gather_tokens(x_BTD: torch.Tensor, idx_BC: torch.Tensor) -> torch.Tensor:
    """The tokens ``idx_BC`` of every sequence, in the order given: [B, C, D]."""
    return x_BTD.gather(1, idx_BC[..., None].expand(-1, -1, x_BTD.shape[-1]))


def scatter_tokens(x_BTD: torch.Tensor, idx_BC: torch.Tensor,
                   new_BCD: torch.Tensor) -> torch.Tensor:
    """``x_BTD`` with the rows ``idx_BC`` replaced by ``new_BCD`` (out of place). The indices of a
    row are unique (an expert-choice selection), so this is a plain scatter: every other token
    keeps its input exactly, and the gradient of a replaced row goes to ``new_BCD`` only."""
    return x_BTD.scatter(1, idx_BC[..., None].expand(-1, -1, x_BTD.shape[-1]), new_BCD)


def membership_bce(
    logits_BT: torch.Tensor, target_BT: torch.Tensor, valid_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Binary cross-entropy of ``logits_BT`` against top-k membership ``target_BT`` (bool), averaged
    over the valid tokens in (at least) float32. Both causal-routing methods of Mixture-of-Depths train
    with it: method 1 on the router logits themselves, method 2 on a stop-gradient predictor."""
    work = torch.promote_types(logits_BT.dtype, torch.float32)  # float64 stays float64
    bce_BT = F.binary_cross_entropy_with_logits(
        logits_BT.to(work), target_BT.to(work), reduction="none")
    return masked_mean(bce_BT, valid_BT)


def causal_route(logits_BT: torch.Tensor, valid_BT: torch.Tensor | None = None) -> torch.Tensor:
    """The causal routing rule for sampling: a token enters the block iff sigmoid(logit) > 0.5,
    i.e. logit > 0 (Mixture-of-Depths, sampling). Padding never enters. Returns bool [B, T]."""
    routed_BT = logits_BT > 0
    return routed_BT if valid_BT is None else routed_BT & valid_BT


def masked_agreement(a_BT: torch.Tensor, b_BT: torch.Tensor,
                     valid_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Fraction of valid tokens where the bool masks agree (e.g. causal rule vs. top-k), float32."""
    return masked_mean((a_BT == b_BT).float(), valid_BT)


def causal_rule_stats(logits_BT: torch.Tensor, selected_BT: torch.Tensor,
                      candidates_BT: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """How a depth router's causal rule (``causal_route``: logit > 0) does against the sequence
    top-k it stands in for at sampling, over the candidate tokens (None: all): (agreement, the
    fraction of tokens where rule and top-k agree; fraction, the tokens the rule would route),
    float32 scalars. Mixture-of-Depths and Mixture-of-Recursions log both."""
    rule_BT = causal_route(logits_BT, candidates_BT)
    n = candidates_BT.sum() if candidates_BT is not None else logits_BT.new_tensor(
        logits_BT.numel())
    return (masked_agreement(rule_BT, selected_BT, candidates_BT),
            rule_BT.sum().float() / n.clamp_min(1).float())
