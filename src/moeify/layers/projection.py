"""The projections of the attention layers in one matmul per input (``project_by_input``):
dense attention and MoH (Q, K, V), MoA (K, V), SwitchHead (a projection and its selection).

Shape legend: D d_model.
"""

from __future__ import annotations

import math

import torch

from moeify.ops.memo import stamps


def project_by_input(pieces, memo: dict | None = None) -> dict[str, torch.Tensor]:
    """``{key: x @ w}`` for every ``(key, x [..., D], w [D, n] or [D, ...])`` piece (a w of
    more dimensions, e.g. a permuted view of expert weights, acts as w.reshape(D, -1)); the
    pieces that read the same input tensor share one matmul ``x @ [w1 | w2 | ...]`` split back
    into views: one pass over the input and one input-gradient matmul instead of one per piece.
    A product that autograd would save as it is (RoPE attention's value) is better left out: as
    a view it keeps the whole fused output alive.

    ``memo`` (a dict the calling layer owns) keeps the concatenated weights between calls that
    need no gradient for them (evaluation, decoding: otherwise every call, every token, copies
    them), rebuilt when any piece's weights change (another tensor, or an in-place update)."""
    groups: dict[int, tuple[torch.Tensor, list]] = {}
    for key, x, w in pieces:
        groups.setdefault(id(x), (x, []))[1].append((key, w))
    out: dict[str, torch.Tensor] = {}
    for x, members in groups.values():
        if len(members) == 1 and members[0][1].dim() == 2:
            out[members[0][0]] = x @ members[0][1]
            continue
        w = _fused_weights([w for _, w in members], tuple(k for k, _ in members), memo)
        out.update(zip((key for key, _ in members),
                       (x @ w).split([math.prod(w.shape[1:]) for _, w in members], -1)))
    return out


def _fused_weights(ws: list[torch.Tensor], keys: tuple, memo: dict | None) -> torch.Tensor:
    """[w1 | w2 | ...], from ``memo`` where no gradient is needed and nothing changed."""
    def cat():
        return torch.cat([w.reshape(w.shape[0], -1) for w in ws], 1)

    if torch.compiler.is_compiling():
        # Traced, the memo's contents would become guards: a recompile per block and per
        # optimizer step (the weights' versions), until dynamo gives up and runs eagerly.
        return cat()
    if memo is None or (torch.is_grad_enabled() and any(w.requires_grad for w in ws)):
        if memo:
            memo.clear()  # training again: hold no stale copy
        return cat()
    key = stamps(*ws)
    if key is None:
        return cat()
    hit = memo.get(keys)
    if hit is None or hit[0] != key:
        hit = memo[keys] = (key, cat())
    return hit[1]
