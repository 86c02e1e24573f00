"""Routing: which experts each token goes to, and with which gate.

Shape legend: M tokens (rows), E experts, K experts kept per token, B batch, S sequence, C kept.

Ties between equal scores go to the lowest index, on every device (``top_indices``).

Scores are always computed in float32 whatever the input dtype (Switch Transformer's "selective
precision"; SwitchHead and sigma-MoE do the same), also under autocast: ``router_logits``
computes a router's logits that way. Expert indices carry no gradient; the gate values do,
through the scores they were gathered from.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


class TopK(NamedTuple):
    gates: torch.Tensor  # [..., K] float32, differentiable
    idx: torch.Tensor  # [..., K] int64, no gradient
    scores: torch.Tensor  # [..., E] float32: the full sigmoid or softmax the gates came from


def router_logits(x_MD: torch.Tensor, w_ED: torch.Tensor,
                  bias_E: torch.Tensor | None = None) -> torch.Tensor:
    """x · wᵀ (+ bias) in float32: [..., E]. Autocast is switched off around it, because autocast
    would run the Linear in half precision even on float32 operands, and a router's choices are
    sensitive to the rounding (Switch §2.4: selection scores in float32)."""
    with torch.autocast(x_MD.device.type, enabled=False):
        return F.linear(x_MD.float(), w_ED.float(), None if bias_E is None else bias_E.float())


def selection_logits(x_MD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """x · wᵀ for attention-expert selection: in the input's precision, except under autocast,
    where it goes through ``router_logits`` so the scores stay float32 (SwitchHead Eq. 7-10)."""
    if torch.is_autocast_enabled(x_MD.device.type):
        return router_logits(x_MD, w_ED)
    return x_MD @ w_ED.t()


def _check_k(k: int, num_experts: int) -> None:
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must lie in [1, {num_experts}] (the number of experts), got {k}")


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest scores along the last dimension, largest first, and among
    equal scores the lowest index first: the one tie-break of every router in moeify, on every
    device. ``torch.topk`` leaves ties unspecified, and its CPU and CUDA kernels break them
    differently (a zero-initialised router ties every expert: MoA then routed differently on
    each device). A stable descending sort keeps equal scores in index order."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k].contiguous()


def _topk(scores: torch.Tensor, k: int, exclude: torch.Tensor | None,
          bias: torch.Tensor | None = None) -> TopK:
    _check_k(k, scores.shape[-1])
    ranked = scores.detach()
    if bias is not None:
        # Loss-free balancing (DeepSeek-V3 §2.1.2, Wang et al. 2024, arXiv 2408.15664): the bias
        # shifts the choice only; the gates are gathered from the unbiased scores below.
        ranked = ranked + bias.detach().to(ranked.dtype)
    if exclude is not None:
        ranked = ranked.masked_fill(exclude, float("-inf"))
    idx = top_indices(ranked, k)
    return TopK(scores.gather(-1, idx), idx, scores)


def sigmoid_topk(logits: torch.Tensor, k: int, *, exclude: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> TopK:
    """SwitchHead Eq. 7-8 / sigma-MoE: s = sigmoid(logits) in float32, keep the k largest per row,
    gates are the raw sigmoid values (no renormalisation). ``exclude`` (bool, broadcastable to
    logits) removes experts from the choice, e.g. for expert dropout. ``bias`` [E]: added to the
    scores for the choice only (loss-free balancing); the gates stay the unbiased scores."""
    return _topk(torch.sigmoid(logits.float()), k, exclude, bias)


def softmax_topk(
    logits: torch.Tensor, k: int, *, renormalize: bool = False, exclude: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> TopK:
    """Switch / MoA routing: p = softmax(logits) in float32 over all experts, keep the top k.
    With ``renormalize`` the k kept gates are rescaled to sum to 1. ``bias`` [E]: added to the
    probabilities for the choice only (loss-free balancing); the gates stay unbiased."""
    probs = torch.softmax(logits.float(), dim=-1)
    out = _topk(probs, k, exclude, bias)
    if renormalize:
        out = out._replace(gates=out.gates / out.gates.sum(-1, keepdim=True))
    return out


def expert_choice_count(seq_len: int, capacity: float) -> int:
    """Tokens an expert-choice router keeps out of ``seq_len``: ceil(capacity * seq_len), at least
    1. (Mixture-of-Depths' k = C * S; ceil so that a short sequence still routes a token.)"""
    if not 0.0 < capacity <= 1.0:
        raise ValueError(f"capacity must lie in (0, 1], got {capacity}")
    return max(1, math.ceil(capacity * seq_len - 1e-9))


def expert_choice(
    scores_BS: torch.Tensor, capacity: float, *, valid_BS: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-choice top-c over each sequence (Mixture-of-Depths): per row of ``scores_BS`` keep the
    ``expert_choice_count(S, capacity)`` highest-scoring positions. Returns (idx_BC ascending in
    position, so causal order is kept; selected_BS bool mask).

    With ``valid_BS`` (False = padding) a row keeps ``expert_choice_count(its valid count,
    capacity)`` of its valid positions, as it would unpadded, so right-padding a sequence to batch
    it does not change its routing. ``idx_BC`` keeps C = expert_choice_count(S) columns; those
    beyond a row's own count (and any padding) are not in ``selected_BS``."""
    S = scores_BS.shape[-1]
    c = expert_choice_count(S, capacity)
    ranked = scores_BS.detach().float()
    if valid_BS is None:
        idx = top_indices(ranked, c).sort(dim=-1).values
        selected = torch.zeros_like(scores_BS, dtype=torch.bool).scatter_(-1, idx, True)
        return idx, selected
    valid_BS = valid_BS.bool()
    ranked = ranked.masked_fill(~valid_BS, float("-inf"))
    n_B = valid_BS.sum(-1, keepdim=True)
    c_B = torch.ceil(capacity * n_B - 1e-9).clamp_min(1)  # expert_choice_count per row
    by_score = top_indices(ranked, c)
    keep = torch.arange(c, device=scores_BS.device) < c_B
    keep &= valid_BS.gather(-1, by_score)
    selected = torch.zeros_like(valid_BS).scatter_(-1, by_score, keep)
    return by_score.sort(dim=-1).values, selected


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How often each id in [0, n) occurs in ``ids`` (any shape), int64 [n]. The same counts as
    ``torch.bincount(ids, minlength=n)``, but as a scatter-add into a buffer of fixed size:
    bincount's output size depends on the values (max id + 1 when that exceeds ``minlength``),
    which torch.compile cannot trace without a graph break. Integer addition is exact in any
    order, so the counts are deterministic on every device."""
    flat = ids.reshape(-1).long()
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float, k: int = 1) -> int:
    """Switch Transformer: capacity = ceil(tokens * k / experts * capacity_factor)."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity factor must be positive, got {capacity_factor}")
    return math.ceil(num_tokens * k / num_experts * capacity_factor)


def capacity_mask(
    idx_MK: torch.Tensor,
    num_experts: int,
    capacity: int,
    *,
    valid_M: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which routed (token, choice) pairs fit in their expert's capacity, with position priority:
    within an expert, all first choices come before all second choices (GShard / Switch), and
    within a choice rank earlier tokens come first. Invalid (padding) tokens take no capacity and
    are never kept. Returns a bool mask [M, K]."""
    M, K = idx_MK.shape
    flat_KM = idx_MK.t().reshape(-1).long()  # choice-major: every top-1 before any top-2
    if valid_M is not None:
        flat_KM = torch.where(valid_M.repeat(K), flat_KM, num_experts)  # park padding past the end
    order = torch.argsort(flat_KM, stable=True)
    counts = count_ids(flat_KM, num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(order.numel(), device=idx_MK.device) - starts[flat_KM[order]]
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    keep = (rank < capacity) & (flat_KM < num_experts)
    return keep.view(K, M).t()


@torch.no_grad()
def count_selections(idx: torch.Tensor, num_experts: int,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """How often each expert was selected, int64 [num_experts]: every entry of ``idx`` (any
    shape) is one selection; those with ``keep`` False (padding, dropped tokens; broadcastable
    to ``idx``) are not counted. One scatter-add (``count_ids``), no host sync. The one way every
    routed layer counts its selections."""
    flat = idx.reshape(-1).long()
    if keep is not None:
        flat = torch.where(keep.expand_as(idx).reshape(-1), flat, num_experts)  # park past the end
    return count_ids(flat, num_experts + 1)[:num_experts]
