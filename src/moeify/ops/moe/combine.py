"""The combine step of every expert matmul, written once: per-pair products to the gated sums
over a row's experts (in G groups, or over R rows), and the output gradient back to the pairs.

Shape legend: M rows, K experts per row, N = M · K pairs, P slots, F output width, G groups,
R rows summed per output, O output rows (M / R · G).

Pair n = m · K + j is row m's j-th expert. A gated output row sums ``per = K / G · R``
consecutive pairs: row m's group g (pairs j in [g·K/G, (g+1)·K/G)), or all K pairs of R
consecutive rows. So the combine is one gate-weighted sum over runs of ``per`` pairs,
wherever the kernel left the products (``slot_N``: pair -> slot; None: in pair order).
"""

from __future__ import annotations

import torch

from moeify.ops.moe.layout import SlotLayout, gather_rows, slot_sums


def per_output(k: int, groups: int, sum_rows: int, gated: bool) -> int:
    """The pairs summed into one output row (1 without gates: one output per pair)."""
    return k // groups * sum_rows if gated else 1


def combine(ys_PF: torch.Tensor, gates_MK: torch.Tensor | None, k: int, groups: int = 1,
            sum_rows: int = 1, slot_N: torch.Tensor | None = None) -> torch.Tensor:
    """Products to the expert matmul's output: [M, K, F] without gates; with gates the
    gate-weighted sums, [M / R, F] (G = 1) or [M, G, F]. ``ys_PF``: the product of every pair,
    in slot ``slot_N[n]`` (None: row n, pair order)."""
    Fo = ys_PF.shape[-1]
    N = ys_PF.shape[0] if slot_N is None else slot_N.shape[0]
    M = N // k
    if gates_MK is None:
        y = ys_PF if slot_N is None else ys_PF.index_select(0, slot_N)
        return y.reshape(M, k, Fo)
    per = per_output(k, groups, sum_rows, True)
    gate_N = gates_MK.reshape(-1).to(ys_PF.dtype)
    if slot_N is None:
        y = (ys_PF.reshape(-1, per, Fo) * gate_N.view(-1, per, 1)).sum(1)
    else:
        y = slot_sums(ys_PF, slot_N, gate_N, per)
    return y.view(M, groups, Fo) if groups > 1 else y


def spread(grad_y: torch.Tensor, lay: SlotLayout, per: int) -> torch.Tensor:
    """The output gradient of every slot's pair, [P, F]: slot p receives the gradient of the
    output row its pair was summed into (``per`` pairs per output row); 0 in padding slots.
    Also materialises stride-0 gradients (y.sum().backward())."""
    g_OF = grad_y.reshape(-1, grad_y.shape[-1])
    if lay.identity:
        if per == 1:
            return g_OF.contiguous()
        O, Fo = g_OF.shape
        return g_OF.view(O, 1, Fo).expand(O, per, Fo).reshape(O * per, Fo)
    return gather_rows(g_OF.contiguous(), lay, lay.rows(per))


def dense_gates(idx_MGK: torch.Tensor, gates_MGK: torch.Tensor, num_experts: int,
                like: torch.Tensor) -> torch.Tensor:
    """The gates scattered over every expert, [M, G, num_experts] in ``like``'s dtype and
    device: gates[m, g, k] at expert idx[m, g, k], zero where not selected (repeated ids add)."""
    M, G, _ = idx_MGK.shape
    dense_MGE = torch.zeros(M, G, num_experts, dtype=like.dtype, device=like.device)
    return dense_MGE.scatter_add_(2, idx_MGK.long(), gates_MGK.to(like.dtype))


__all__ = ["combine", "dense_gates", "per_output", "spread"]
