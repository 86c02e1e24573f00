"""The attention core shared by every attention layer: masks, a fast path and a reference path.

Shape legend
    B batch     H query heads     Hk key/value heads (H, or 1 broadcast over the query heads)
    T query (destination) tokens  S source (key/value) tokens       C head channels

Masks (docs/interfaces.md): with default positions query i sits at S - T + i and key j at j, so a
causal query sees key j iff j <= S - T + i (memory or cached tokens are fully visible); with
explicit positions it sees key j iff pos_k[j] <= pos_q[i]. ``valid_k`` removes keys (padding,
tokens a Mixture-of-Depths router skipped). A query row left with no visible key outputs zeros
(instead of the NaN of a softmax over nothing), forward and backward.

Implementations (``impl=``):
    "auto"       torch.nn.functional.scaled_dot_product_attention (SDPA) when the logits are the
                 plain scaled dot product; the explicit path when an additive term exists (the
                 Transformer-XL position logits) or the scale is a learned tensor.
    "reference"  always explicit: logits, masked_fill(-inf), softmax in at least float32, dropout,
                 product with V. Obviously correct; the tests compare "auto" against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION_IMPLS = ("auto", "reference")
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class AttentionMask:
    """Which keys each query may attend to.

    allowed_BTS: bool [B or 1, T, S], True = visible; None = every key visible (or causal_square).
    causal_square: the plain lower-triangular mask with T == S (SDPA's ``is_causal``).
    nonempty_BT: bool [B or 1, T]: False for query rows without any visible key; such rows are
        unmasked inside ``allowed`` (keeping the softmax finite) and zeroed after attending.
        None when no row can be empty.
    """

    allowed_BTS: torch.Tensor | None
    causal_square: bool = False
    nonempty_BT: torch.Tensor | None = None


def build_mask(
    T: int,
    S: int,
    *,
    causal: bool,
    device=None,
    pos_q_BT: torch.Tensor | None = None,
    pos_k_BS: torch.Tensor | None = None,
    valid_k_BS: torch.Tensor | None = None,
) -> AttentionMask:
    """The mask for T queries over S keys. Pass both ``pos_q_BT`` and ``pos_k_BS`` for explicit
    positions, neither for the default (contiguous) ones."""
    if (pos_q_BT is None) != (pos_k_BS is None):
        raise ValueError("pass both pos_q_BT and pos_k_BS, or neither")
    explicit = pos_q_BT is not None
    allowed = None
    if causal:
        if explicit:
            allowed = pos_k_BS[:, None, :] <= pos_q_BT[:, :, None]
        else:
            if T == S and valid_k_BS is None:
                return AttentionMask(None, causal_square=True)
            if T == 1 and valid_k_BS is None:  # the newest token sees every key (decoding)
                return AttentionMask(None)
            i_T1 = torch.arange(T, device=device)[:, None]
            j_1S = torch.arange(S, device=device)[None, :]
            allowed = (j_1S <= i_T1 + (S - T))[None]
    if valid_k_BS is not None:
        v_B1S = valid_k_BS.bool()[:, None, :]
        allowed = v_B1S.expand(-1, T, -1) if allowed is None else allowed & v_B1S
    if allowed is None:
        return AttentionMask(None)
    # Rows can only be empty with a validity mask, explicit positions, or more queries than keys.
    if valid_k_BS is None and not explicit and T <= S:
        return AttentionMask(allowed)
    nonempty = allowed.any(-1)
    return AttentionMask(allowed | ~nonempty[..., None], nonempty_BT=nonempty)


def _explicit(q, k, v, mask: AttentionMask, scale, bias, dropout_p):
    # Scaling q before the product keeps fp16 logits in range (the SwitchHead authors scale q
    # and k by d_head^(-1/4) each for the same reason).
    logits = (q * scale) @ k.transpose(-1, -2)
    if bias is not None:
        logits = logits + bias
    T, S = logits.shape[-2:]
    # In place: ``logits`` is a fresh product or sum whose backward does not need it.
    if mask.causal_square:
        tri = torch.ones(T, S, dtype=torch.bool, device=logits.device).tril()
        logits.masked_fill_(~tri, float("-inf"))
    elif mask.allowed_BTS is not None:
        logits.masked_fill_(~mask.allowed_BTS[:, None], float("-inf"))
    work = torch.promote_types(logits.dtype, torch.float32)
    probs = torch.softmax(logits.to(work), -1).to(v.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return probs @ v


def _sdpa(q, k, v, mask: AttentionMask, scale: float, dropout_p):
    kw = {}
    if k.shape[1] != q.shape[1]:
        if _SDPA_GQA:
            kw["enable_gqa"] = True
        else:
            k = k.expand(-1, q.shape[1], -1, -1)
            v = v.expand(-1, q.shape[1], -1, -1)
    attn_mask = None if mask.allowed_BTS is None else mask.allowed_BTS[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=mask.causal_square, scale=scale, **kw)


def attend(
    q_BHTC: torch.Tensor,
    k_BHSC: torch.Tensor,
    v_BHSC: torch.Tensor,
    mask: AttentionMask,
    *,
    scale: float | torch.Tensor,
    bias_BHTS: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    impl: str = "auto",
) -> torch.Tensor:
    """softmax(scale · q kᵀ + bias, masked) v per head: [B, H, T, C]. Keys and values may have one
    head shared by all query heads. ``dropout_p`` applies to the attention probabilities (pass 0
    outside training)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; "
                         f"choose one of {', '.join(ATTENTION_IMPLS)}")
    plain = bias_BHTS is None and not isinstance(scale, torch.Tensor)
    if impl == "auto" and plain:
        out = _sdpa(q_BHTC, k_BHSC, v_BHSC, mask, float(scale), dropout_p)
    else:
        out = _explicit(q_BHTC, k_BHSC, v_BHSC, mask, scale, bias_BHTS, dropout_p)
    if mask.nonempty_BT is not None:
        out = out * mask.nonempty_BT[:, None, :, None].to(out.dtype)
    return out


__all__ = ["ATTENTION_IMPLS", "AttentionMask", "build_mask", "attend"]
