"""The Transformer-XL attention core as one autograd Function, for default (contiguous) positions.

Shape legend
    B batch     H query heads     Hk key/value heads (H, or 1 shared by every query head)
    T queries   S keys            C head channels
    R relative distances in the position table (S for causal attention: S-1 ... 0; S + T - 1
      for cross-attention: S-1 ... 1-T)          Hp position heads (H, or 1 shared)
    G row groups of the position products (Hp)   N rows per group (B·T, or B·H·T when Hp = 1)

    out = softmax(qc · kᵀ + rel_shift(qp · Pᵀ), masked) · v

with qc, qp the content and position queries (already scaled, biases added) and P [Hp, R, C]
the projected distance table (``moeify.ops.positional.xl_position_table``). This is the same
function as ``rel_shift(xl_logits_contiguous(...))`` added to the logits of
``moeify.ops.attention.attend`` (the reference the tests compare against), without the work
autograd would do around it:

- the diagonal shift is a strided view (row stride R - 1) added in place to the content logits,
  not a padded copy and a reshape;
- the position products fold the batch into the rows of one matmul per head (or one matmul
  for a shared position head), so P is never expanded over the batch, and its gradient needs no
  sum over the batch;
- in the backward the logit gradient is written once into a zero buffer laid out so that the
  un-shifted gradient is again a strided view (row stride W + 1, W = S + T - 1) that both
  position matmuls read directly.

Only the probabilities are saved from the forward (plus the inputs); dropout on them is not
supported here (the caller falls back to the reference path).
"""

from __future__ import annotations

import torch

from moeify.ops.amp import amp_backward, amp_forward, autocast_dtype

_NEG_INF = float("-inf")


def _groups(qp_BHTC: torch.Tensor, Hp: int) -> torch.Tensor:
    """qp as [G, N, C]: rows of one position head together."""
    B, H, T, C = qp_BHTC.shape
    if Hp == 1:
        return qp_BHTC.reshape(1, B * H * T, C)
    return qp_BHTC.transpose(0, 1).reshape(H, B * T, C)


def _block_strides(B: int, H: int, Hp: int, block: int) -> tuple[int, int]:
    """(batch, head) strides of the [T, ·] blocks in a grouped layout: head-major when each
    head has its own position table, batch-major when one table serves all."""
    return (H * block, block) if Hp == 1 else (block, B * block)


class _XLAttention(torch.autograd.Function):
    @staticmethod
    @amp_forward
    def forward(ctx, qc, qp, k, v, p_HRC, blocked, causal_square):
        B, H, T, C = qc.shape
        Hk, S = k.shape[1], k.shape[2]
        Hp, R = p_HRC.shape[0], p_HRC.shape[1]
        shared_kv = Hk == 1 and H > 1
        if shared_kv:  # one key/value head: fold the query heads into the rows
            Q, K, V = qc.reshape(B, H * T, C), k.reshape(B, S, C), v.reshape(B, S, C)
        else:
            Q, K, V = qc.reshape(B * H, T, C), k.reshape(B * H, S, C), v.reshape(B * H, S, C)
        logits = torch.bmm(Q, K.transpose(1, 2)).view(B, H, T, S)
        qp_GNC = _groups(qp, Hp)
        bd_GNR = torch.bmm(qp_GNC, p_HRC.transpose(1, 2))
        sB, sH = _block_strides(B, H, Hp, T * R)
        # out[.., i, j] = raw[.., i, j + T - 1 - i]: row stride R - 1, offset T - 1 (entries of
        # keys after the query read a neighbouring row: finite garbage the mask removes).
        logits.add_(bd_GNR.as_strided((B, H, T, S), (sB, sH, R - 1, 1), T - 1))
        if causal_square:
            tri = torch.ones(T, S, dtype=torch.bool, device=logits.device).tril()
            logits.masked_fill_(~tri, _NEG_INF)
        elif blocked is not None:
            logits.masked_fill_(blocked, _NEG_INF)
        work = torch.promote_types(logits.dtype, torch.float32)
        probs = torch.softmax(logits.to(work), -1).to(v.dtype)
        P = probs.view(B, H * T, S) if shared_kv else probs.view(B * H, T, S)
        out = torch.bmm(P, V).view(B, H, T, C)
        # One query for both terms (SwitchHead): keep only its per-head copy qp_GNC and rebuild
        # Q from it in the backward rather than holding the same values twice.
        dedup = qc is qp and Hp == H > 1
        ctx.save_for_backward(None if dedup else Q, K, V, qp_GNC, p_HRC, probs)
        ctx.shape = (B, H, T, S, C, Hk, Hp, R, shared_kv)
        return out

    @staticmethod
    @amp_backward
    def backward(ctx, grad_out):
        Q, K, V, qp_GNC, p_HRC, probs = ctx.saved_tensors
        B, H, T, S, C, Hk, Hp, R, shared_kv = ctx.shape
        if Q is None:
            Q = qp_GNC.view(H, B, T, C).transpose(0, 1).reshape(K.shape[0], -1, C)
        need_qc, need_qp, need_k, need_v, need_p = ctx.needs_input_grad[:5]
        nb = B if shared_kv else B * H
        dO = grad_out.contiguous().view(nb, -1, C)
        P = probs.view(nb, -1, S)
        grad_qc = grad_qp = grad_k = grad_v = grad_p = None
        if need_v:
            grad_v = torch.bmm(P.transpose(1, 2), dO).view(B, Hk, S, C)
        dP = torch.bmm(dO, V.transpose(1, 2))
        # In at least float32, as the forward's softmax (the probabilities are stored in the
        # value dtype, as the reference path stores them).
        work = torch.promote_types(probs.dtype, torch.float32)
        dL = torch._softmax_backward_data(dP.view(B, H, T, S).to(work), probs.to(work), -1,
                                          work).to(Q.dtype)
        if need_qc:
            grad_qc = torch.bmm(dL.view(nb, -1, S), K).view(B, H, T, C)
        if need_k:
            grad_k = torch.bmm(dL.view(nb, -1, S).transpose(1, 2), Q).view(B, Hk, S, C)
        if need_qp or need_p:
            # Un-shift: row t of a block lands at t·W + T - 1 in a zero buffer of rows W + 1
            # apart, so that raw[t, m] = dL[t, m - (T - 1 - t)] (0 outside) is the view
            # buffer[t·(W + 1) + m]; the blocks are laid out group by group (module docstring).
            W = S + T - 1
            block = T * (W + 1)
            buf = dL.new_zeros(B * H * block)
            sB, sH = _block_strides(B, H, Hp, block)
            buf.as_strided((B, H, T, S), (sB, sH, W, 1), T - 1).copy_(dL)
            G, N = qp_GNC.shape[:2]
            raw_GNR = buf.as_strided((G, N, R), (N * (W + 1), W + 1, 1))
            if need_qp:
                g_GNC = torch.bmm(raw_GNR, p_HRC)
                grad_qp = (g_GNC.view(B, H, T, C) if Hp == 1
                           else g_GNC.view(H, B, T, C).transpose(0, 1))
            if need_p:
                grad_p = torch.bmm(raw_GNR.transpose(1, 2), qp_GNC)
        return grad_qc, grad_qp, grad_k, grad_v, grad_p, None, None


def xl_attention(qc_BHTC: torch.Tensor, qp_BHTC: torch.Tensor, k_BHSC: torch.Tensor,
                 v_BHSC: torch.Tensor, p_HRC: torch.Tensor, *,
                 allowed_BTS: torch.Tensor | None = None,
                 causal_square: bool = False) -> torch.Tensor:
    """softmax(qc·kᵀ + rel_shift(qp·Pᵀ), masked)·v per head: [B, H, T, C] (module docstring).
    ``allowed_BTS`` (bool [B or 1, T, S], True = visible) or ``causal_square`` give the mask;
    the caller zeroes rows without any visible key. Operands are cast to one dtype: the autocast
    dtype under autocast, else that of ``qc``."""
    B, H, T, C = qc_BHTC.shape
    S, R = k_BHSC.shape[-2], p_HRC.shape[-2]
    if not S <= R <= S + T - 1:
        raise ValueError(f"the position table must cover distances S-1 down to 0 (causal) or "
                         f"1-T (cross-attention): got R={R} rows for S={S}, T={T}")
    blocked = None if allowed_BTS is None else ~allowed_BTS[:, None]
    # A custom Function is invisible to autocast: its matmul policy applied to the operands here
    # (moeify.ops.amp).
    dt = autocast_dtype(qc_BHTC.device.type) or qc_BHTC.dtype
    return _XLAttention.apply(qc_BHTC.to(dt), qp_BHTC.to(dt), k_BHSC.to(dt), v_BHSC.to(dt),
                              p_HRC.to(dt), blocked, causal_square)


__all__ = ["xl_attention"]
