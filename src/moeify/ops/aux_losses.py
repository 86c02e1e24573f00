"""Auxiliary routing losses, unweighted: the layer multiplies by its coefficient.

Every loss over tokens takes an optional ``valid_M`` bool mask so padding tokens count neither
in the loss nor in its normalisation (``cv_squared`` works on per-expert sums, already masked by
its caller). All are computed in float32.
Shape legend: M tokens, E experts.
"""

from __future__ import annotations

import torch


def masked_mean(x_M: torch.Tensor, valid_M: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``x_M`` over the valid entries (all when None); 0 when none is valid. Any shape,
    ``valid_M`` of the same shape."""
    if valid_M is None:
        return x_M.mean()
    w = valid_M.to(x_M.dtype)
    return (x_M * w).sum() / w.sum().clamp_min(1.0)


def _masked_rows_mean(x_ME: torch.Tensor, valid_M: torch.Tensor | None) -> torch.Tensor:
    if valid_M is None:
        return x_ME.mean(0)
    w = valid_M.to(x_ME.dtype)[:, None]
    return (x_ME * w).sum(0) / w.sum().clamp_min(1.0)


def z_loss(logits_ME: torch.Tensor, valid_M: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss (ST-MoE, Zoph et al. 2022, Eq. 5): mean over tokens of logsumexp(logits)^2."""
    return masked_mean(torch.logsumexp(logits_ME.float(), -1).square(), valid_M)


def switch_balance_loss(
    probs_ME: torch.Tensor, top1_M: torch.Tensor, valid_M: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch Transformer load-balancing loss (Fedus et al. 2022, Eq. 4-6): N * sum_i f_i * P_i,
    f_i the fraction of tokens whose top-1 expert is i (no gradient), P_i the mean router
    probability of expert i."""
    E = probs_ME.shape[-1]
    onehot = torch.nn.functional.one_hot(top1_M.long(), E).float()
    f_E = _masked_rows_mean(onehot, valid_M)
    P_E = _masked_rows_mean(probs_ME.float(), valid_M)
    return E * (f_E.detach() * P_E).sum()


def topk_balance_loss(probs_ME: torch.Tensor, idx_MK: torch.Tensor,
                      valid_M: torch.Tensor | None = None) -> torch.Tensor:
    """The Switch loss with k choices per token: E * sum_i f_i * P_i, f_i the fraction of tokens
    that have expert i among their top-k (no gradient; sums to k over the experts), P_i the mean
    router probability of expert i. The load-balance loss of MoH's authors' code (arXiv
    2410.11842, Sec. 3.2). In float32, or float64 for float64 probabilities."""
    E = probs_ME.shape[-1]
    dt = torch.promote_types(probs_ME.dtype, torch.float32)
    chosen_ME = torch.zeros(probs_ME.shape, dtype=dt, device=probs_ME.device).scatter_(
        -1, idx_MK.long(), 1.0)
    f_E = _masked_rows_mean(chosen_ME, valid_M)
    P_E = _masked_rows_mean(probs_ME.to(dt), valid_M)
    return E * (f_E.detach() * P_E).sum()


def global_balance_loss(probs_ME: torch.Tensor, counts_E: torch.Tensor,
                        valid_M: torch.Tensor | None = None) -> torch.Tensor:
    """Global-batch load-balancing loss (Qiu et al. 2025, "Demons in the Detail", arXiv
    2501.11873): the Switch loss E * sum_i f_i * P_i with f_i taken from ``counts_E``, the top-1
    counts of a larger batch than this one (summed over processes and micro-batches by the
    caller; no gradient), and P_i the mean router probability over this batch's valid tokens.
    With the counts of this batch alone it equals ``switch_balance_loss``."""
    return balance_from_counts(mean_router_probs(probs_ME, valid_M), counts_E)


def mean_router_probs(probs_ME: torch.Tensor, valid_M: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """P_i of the balance losses: the mean router probability of each expert over the valid
    rows, float32 [E] (differentiable)."""
    return _masked_rows_mean(probs_ME.float(), valid_M)


def balance_from_counts(P_E: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """E * sum_i f_i * P_i with f_i = counts_i / sum_j counts_j (no gradient through the
    counts): the balance loss of ``global_balance_loss`` from its mean probabilities."""
    c = counts_E.detach().float()
    return P_E.shape[-1] * (c / c.sum().clamp_min(1.0) * P_E).sum()


@torch.no_grad()
def loss_free_bias_update(bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float, *,
                          centre: bool = False) -> torch.Tensor:
    """The new routing bias of loss-free balancing (Wang et al. 2024, arXiv 2408.15664, Alg. 1;
    DeepSeek-V3 §2.1.2): b_i + rate * sign(mean_j c_j - c_i), c the tokens each expert received
    over one optimizer step (all micro-batches, all processes). The paper does not centre the
    bias; ``centre=True`` subtracts the mean of the result (an option some implementations
    apply always). Returns a new tensor of ``bias_E``'s dtype."""
    dt = torch.float32 if bias_E.device.type == "mps" else torch.float64  # MPS: no float64
    c = counts_E.detach().to(dt)
    new = bias_E.detach().to(dt) + rate * torch.sign(c.mean() - c)
    if centre:
        new = new - new.mean()
    return new.to(bias_E.dtype)


def _norm1(v: torch.Tensor) -> torch.Tensor:
    return v / v.sum().clamp_min(1e-9)


def moa_balance_loss(
    probs_ME: torch.Tensor, idx_MK: torch.Tensor, valid_M: torch.Tensor | None = None
) -> torch.Tensor:
    """MoA's switch-style balance loss (Zhang et al. 2022, authors' code):
    E * sum_e norm1(sum_t p_t)_e * norm1(count_e), count_e = how often e is among the top-k."""
    E = probs_ME.shape[-1]
    probs = probs_ME.float()
    counts = torch.nn.functional.one_hot(idx_MK.long(), E).float().sum(1)  # [M, E]
    if valid_M is not None:
        w = valid_M.float()[:, None]
        probs, counts = probs * w, counts * w
    return E * (_norm1(probs.sum(0)) * _norm1(counts.sum(0)).detach()).sum()


def cv_squared(x_E: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation, var / mean^2 (Shazeer et al. 2017's importance loss)."""
    x = x_E.float()
    if x.numel() <= 1:
        return x.new_zeros(())
    return x.var() / (x.mean().square() + 1e-10)


def batch_entropy_loss(logits_ME: torch.Tensor, valid_M: torch.Tensor | None = None) -> torch.Tensor:
    """sigma-MoE regulariser (Csordas et al. 2023): minus the entropy of the batch-averaged
    softmax of the selection logits. Minimising it spreads tokens over experts."""
    p_E = _masked_rows_mean(torch.softmax(logits_ME.float(), -1), valid_M)
    return (p_E * torch.log(p_E.clamp_min(1e-12))).sum()


def router_entropy(probs_ME: torch.Tensor, valid_M: torch.Tensor | None = None) -> torch.Tensor:
    """Mean per-token entropy of a router's distribution (a statistic, not a loss)."""
    p = probs_ME.float()
    return masked_mean(-(p * torch.log(p.clamp_min(1e-12))).sum(-1), valid_M)


def sequence_prob_sums(logits_BTXE: torch.Tensor, valid_BT: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pieces of MoEUT's pooled entropy regulariser for one layer application: per sequence
    the sum over its valid tokens of softmax(logits) over the last dim, ``[B, *X, E]``, and the
    number of valid tokens, ``[B]`` (float). ``logits_BTXE`` [B, T, *X, E] (X: e.g. heads).
    Sums add over applications, so the mean over (tokens, applications) is one division at the
    end (``pooled_entropy_loss``). Computed in float32, or float64 for float64 logits."""
    x = logits_BTXE if logits_BTXE.dtype == torch.float64 else logits_BTXE.float()
    p = torch.softmax(x, -1)
    B, T = p.shape[:2]
    if valid_BT is None:
        return p.sum(1), p.new_full((B,), float(T))
    w = valid_BT.to(p.dtype)
    return (p * w.view(B, T, *([1] * (p.dim() - 2)))).sum(1), w.sum(1)


def pooled_entropy_loss(psum_BXE: torch.Tensor, count_B: torch.Tensor) -> torch.Tensor:
    """MoEUT's regulariser from ``sequence_prob_sums`` (summed over applications): minus the
    entropy of each sequence's mean selection distribution p_b = psum_b / count_b, averaged over
    the sequences (that have a valid token) and the other groups X (heads). The authors'
    ``- entropy_l(log_mean(log_softmax(sel), time)).mean()`` (RobertCsordas/moeut, moeut.py)."""
    p = psum_BXE / count_B.clamp_min(1.0).view(-1, *([1] * (psum_BXE.dim() - 1)))
    neg_h = (p * torch.log(p.clamp_min(1e-12))).sum(-1)  # [B, *X]
    has = (count_B > 0).to(neg_h.dtype).view(-1, *([1] * (neg_h.dim() - 1))).expand_as(neg_h)
    return (neg_h * has).sum() / has.sum().clamp_min(1.0)
