"""Mixture-of-Recursions routing (Bae et al., NeurIPS 2025, arXiv 2507.10524, Sec. 2.2.1): which
tokens of a sequence take each step of a recursion, and the gates that weight their update.

Shape legend: B batch, T tokens, K tokens kept at one recursion step, N recursion steps (N_r).

Expert-choice (each recursion step r is an expert that picks its tokens, Eq. 2 of the paper):

    g_t^r = G(θ_rᵀ H_t^r)                    G = α·sigmoid (the paper's choice), α·tanh, or none
    kept  = the top K_r tokens by g^r among those kept at step r - 1 (hierarchical filtering)
    K_r   = max(1, floor(β_r · T))           β_r the step's capacity, descending in r

The paper writes the selection as g_t^r > P_β(G^r), the β-percentile of the step's scores; its
authors' code takes ``int(capacity · seq_len)`` (at least 1) tokens with a top-k, which is what
``recursion_count`` does, truncating as they do (Mixture-of-Depths' ``expert_choice_count`` rounds
up instead). Ties go to the lowest position (``moeify.ops.routing.top_indices``).

Token-choice (each token picks its depth once, from the recursion block's input H^1):

    g_t = G(Θᵀ H_t^1) ∈ R^N                  G = α·softmax (the paper's choice) or α·sigmoid
    i_t = argmax_j g_t^j                     the token takes recursions 1 .. i_t

Everything here is a pure tensor function: no module state, no host sync; the scores of every
selection are ranked detached (indices carry no gradient, gates do).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moeify.ops.routing import top_indices

EXPERT_GATES = ("sigmoid", "tanh", "linear")
TOKEN_GATES = ("softmax", "sigmoid")


def default_capacities(n_recursions: int) -> tuple[float, ...]:
    """The paper's expert-choice capacities β_r = (N_r - r + 1) / N_r for r = 1 .. N_r (every
    token takes the first step, 1 / N_r of them the last): its authors' default."""
    return tuple((n_recursions - r) / n_recursions for r in range(n_recursions))


def recursion_count(n_tokens: int, capacity: float) -> int:
    """K = max(1, floor(capacity · n_tokens)): the tokens an expert-choice step keeps (the
    authors' ``max(1, int(capacity_factor * seq_len))``)."""
    if not 0.0 < capacity <= 1.0:
        raise ValueError(f"capacity must lie in (0, 1], got {capacity}")
    return max(1, math.floor(capacity * n_tokens))


def router_logits(x_BTD: torch.Tensor, w_ND: torch.Tensor) -> torch.Tensor:
    """x · wᵀ in at least float32 (float64 stays float64), also under autocast: [B, T, N]."""
    work = torch.promote_types(x_BTD.dtype, torch.float32)
    with torch.autocast(x_BTD.device.type, enabled=False):
        return F.linear(x_BTD.to(work), w_ND.to(work))


def expert_gate(logits: torch.Tensor, fn: str, alpha: float) -> torch.Tensor:
    """g = α·sigmoid(logit), α·tanh(logit) or the logit itself ("linear", α unused)."""
    if fn == "sigmoid":
        return alpha * torch.sigmoid(logits)
    if fn == "tanh":
        return alpha * torch.tanh(logits)
    if fn == "linear":
        return logits
    raise ValueError(f"unknown expert-choice gate {fn!r}; choose one of {EXPERT_GATES}")


def hierarchical_topk(
    gate_BT: torch.Tensor,
    capacity: float,
    candidates_BT: torch.Tensor | None = None,
    valid_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One expert-choice step: the top ``recursion_count(T, capacity)`` tokens of each row by
    ``gate_BT`` among ``candidates_BT`` (the tokens the previous step kept; None: all).

    Returns (idx_BK ascending in position, so the causal order is kept; selected_BT bool; keep_BK
    bool or None). With ``valid_BT`` (False = padding) a row keeps recursion_count(its valid
    tokens, capacity) of its candidates, as it would unpadded; ``idx_BK`` keeps K columns for
    the unpadded length T, and those a row does not keep are False in ``keep_BK`` (None when
    every column is kept)."""
    T = gate_BT.shape[-1]
    k = recursion_count(T, capacity)
    ranked = gate_BT.detach()
    if candidates_BT is not None:
        ranked = ranked.masked_fill(~candidates_BT, float("-inf"))
    by_score = top_indices(ranked, k)
    if valid_BT is None:
        idx = by_score.sort(dim=-1).values
        selected = torch.zeros_like(gate_BT, dtype=torch.bool).scatter_(-1, idx, True)
        return idx, selected, None
    n_B = valid_BT.sum(-1, keepdim=True).double()
    c_B = torch.floor(capacity * n_B).clamp_min(1)  # recursion_count per row
    keep = torch.arange(k, device=gate_BT.device) < c_B
    allowed = valid_BT if candidates_BT is None else candidates_BT & valid_BT
    keep = keep & allowed.gather(-1, by_score)
    idx, order = by_score.sort(dim=-1)
    keep = keep.gather(-1, order)
    selected = torch.zeros_like(valid_BT, dtype=torch.bool).scatter_(-1, idx, keep)
    return idx, selected, keep


def token_choice(logits_BTN: torch.Tensor, fn: str, alpha: float,
                 bias: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-choice depths: (probs_BTN = α·softmax or α·sigmoid of the logits, depth_BT in
    [0, N) = argmax (the token takes recursions 0 .. depth), gate_BT = probs at that depth).
    ``bias`` [N] (loss-free balancing): argmax of probs + bias, the gate still the unbiased
    probability (the authors' ``router_probs = _router_probs + router_bias``)."""
    if fn == "softmax":
        probs = alpha * torch.softmax(logits_BTN, -1)
    elif fn == "sigmoid":
        probs = alpha * torch.sigmoid(logits_BTN)
    else:
        raise ValueError(f"unknown token-choice gate {fn!r}; choose one of {TOKEN_GATES}")
    ranked = probs.detach()
    if bias is not None:
        ranked = ranked + bias.detach().to(ranked.dtype)
    depth = top_indices(ranked, 1)
    return probs, depth[..., 0], probs.gather(-1, depth)[..., 0]
