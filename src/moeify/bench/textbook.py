"""A textbook implementation of the dense attention baseline, for the benchmarks.

Shape legend
    B batch     T query tokens      S source tokens (XL memory + current chunk)      D d_model
    H heads     C d_head            R relative distances (S of them: S - 1 down to 0)

This is the dense layer written the way the papers' reference code writes it, with no attention
to speed: Transformer-XL as in Dai et al. (2019)'s ``RelPartialLearnableMultiHeadAttn`` (content
term with the u bias, position term with the v bias over a table of projected sinusoids, the
pad-and-reshape relative shift, both terms scaled, causal mask with the memory fully visible,
explicit softmax); RoPE by rotating the first half of each head's channels with cos/sin tables
(rotate-half convention, base 10000); or no positions. It reads the weights of a
``moeify.layers.attention.DenseAttention``, so both compute the same function.

``moeify bench attention`` times it beside ``DenseAttention`` to show that the dense baseline the
MoE layers are compared with is not slowed artificially. Only the benchmark's setting is
supported: causal attention, default (contiguous) positions, no cache, no padding.
"""

from __future__ import annotations

import math

import torch


def _sinusoids(S: int, D: int, device, dtype) -> torch.Tensor:
    # Dai et al.'s PositionalEmbedding over pos_seq = S-1 ... 0: [R, D] = [sin ; cos].
    pos_seq = torch.arange(S - 1, -1, -1.0, device=device, dtype=torch.float64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0.0, D, 2.0, device=device,
                                             dtype=torch.float64) / D))
    sinusoid = torch.outer(pos_seq, inv_freq)
    return torch.cat([sinusoid.sin(), sinusoid.cos()], -1)[:, :D].to(dtype)


def _rel_shift(x_BHTR: torch.Tensor) -> torch.Tensor:
    # Dai et al.'s _rel_shift: prepend a zero column, reinterpret the rows, drop the first one.
    B, H, T, R = x_BHTR.shape
    zero_pad = x_BHTR.new_zeros(B, H, T, 1)
    padded = torch.cat([zero_pad, x_BHTR], -1).view(B, H, R + 1, T)
    return padded[:, :, 1:].reshape(B, H, T, R)


def _rotate(x_BSHC: torch.Tensor, pos_S: torch.Tensor, n_rot: int, base: float) -> torch.Tensor:
    if n_rot == 0:
        return x_BSHC
    half = n_rot // 2
    inv_freq = base ** -(torch.arange(0, n_rot, 2, dtype=torch.float64,
                                      device=x_BSHC.device) / n_rot)
    ang = torch.outer(pos_S.to(torch.float64), inv_freq)
    cos = ang.cos().to(x_BSHC.dtype)[None, :, None, :]
    sin = ang.sin().to(x_BSHC.dtype)[None, :, None, :]
    x1, x2 = x_BSHC[..., :half], x_BSHC[..., half:n_rot]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x_BSHC[..., n_rot:]], -1)


def textbook_attention(layer, q_BTD: torch.Tensor, kv_BSD: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """The output [B, T, D] of ``layer`` (a DenseAttention) on causal self-attention over
    ``kv_BSD`` (default ``q_BTD``; with XL memory the last T source tokens are the queries)."""
    c = layer.config
    src_BSD = q_BTD if kv_BSD is None else kv_BSD
    B, T, D = q_BTD.shape
    S = src_BSD.shape[1]
    if S < T:
        raise ValueError(f"the source must hold the {T} queries (and any memory before them), "
                         f"got {S} source tokens")
    H, C = c.n_heads, c.d_head
    q = (q_BTD @ layer.w_q).view(B, T, H, C)
    k = (src_BSD @ layer.w_k).view(B, S, H, C)
    v = (src_BSD @ layer.w_v).view(B, S, H, C)

    if c.pos == "xl":
        r = (_sinusoids(S, D, q.device, q.dtype) @ layer.core.w_pos).view(S, H, C)
        ac = torch.einsum("bthc,bshc->bhts", q + layer.core.bias_u, k)
        bd = _rel_shift(torch.einsum("bthc,rhc->bhtr", q + layer.core.bias_v, r))
        score = (ac + bd) * layer.core.scale
    else:
        if c.pos == "rope":
            pos_S = torch.arange(S, device=q.device)
            q = _rotate(q, pos_S[S - T:], layer.core.rope_n, c.rope_base)
            k = _rotate(k, pos_S, layer.core.rope_n, c.rope_base)
        score = torch.einsum("bthc,bshc->bhts", q, k) / math.sqrt(C)
    # Query i sits at S - T + i: it sees the memory and the current tokens up to itself.
    future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1 + S - T)
    score = score.masked_fill(future, float("-inf"))
    prob = torch.softmax(score, -1)
    o = torch.einsum("bhts,bshc->bthc", prob, v).reshape(B, T, H * C)
    return o @ layer.w_o


__all__ = ["textbook_attention"]
