"""The CPU decoding layouts: a handful of rows, where reading the weights is the cost and the
policy (moeify.ops.moe.cpu.policy.few_rows_impl) takes one of these instead of a sorted layout.

    pairs      one small matmul per routed (row, expert) pair against a view of that expert's
               matrix: reads only the routed matrices and copies none (decoding at batch 1).
    all        every row through every expert in one batched matmul, the routed products picked
               (gated: the gates scattered over all experts, so pick and sums are matmuls):
               E/K times the multiply-adds, but each matrix read once and nothing sorted
               (batched decoding).

and SwitchHead's fused decoding sums (``gated_sum_of_all``, ``gated_group_sum_all``): the "all"
layout's gated sums from products the layer computed in one matmul with its other projections.

Shape legend: M rows, K experts per row, E experts, D input width, F output width, G output
groups, R rows summed per output, T = M / R output rows.
"""

from __future__ import annotations

import torch

from moeify.ops.moe.combine import combine, dense_gates
from moeify.ops.moe.registry import WholeKernel, get_kernel, register


class PairsKernel(WholeKernel):
    name = "pairs"

    def run(self, x_MD, idx_MK, w_EDF, gates_MK, *, groups, sum_rows, plan, batch):
        M, K = idx_MK.shape
        if M * K == 0:
            return get_kernel("gather").run(x_MD, idx_MK, w_EDF, gates_MK, groups=groups,
                                            sum_rows=sum_rows, plan=plan, batch=batch)
        if gates_MK is not None and not (torch.is_grad_enabled() and (
                x_MD.requires_grad or w_EDF.requires_grad or gates_MK.requires_grad)):
            return _pairs_accumulate(x_MD, idx_MK.tolist(), w_EDF, gates_MK.tolist(), groups,
                                     sum_rows)
        ids = idx_MK.tolist()
        rows, mats = x_MD.unsqueeze(1).unbind(0), w_EDF.unbind(0)  # views: one op each
        y_NF = torch.cat([torch.mm(rows[m], mats[e]) for m in range(M) for e in ids[m]])
        return combine(y_NF, gates_MK, K, groups, sum_rows)


def _pairs_accumulate(x_MD, ids, w_EDF, gates, groups, sum_rows):
    """"pairs" without autograd (decoding): each pair is one matmul that adds its gate-weighted
    product into its output row, alpha = the gate (gate, group and row sums inside the BLAS
    call; no per-pair products, no concatenation)."""
    M, K, Fo = len(ids), len(ids[0]), w_EDF.shape[-1]
    per_group = K // groups
    out = x_MD.new_empty(M // sum_rows * groups, Fo)
    for m in range(M):
        x_1D = x_MD[m:m + 1]
        for j, (e, g) in enumerate(zip(ids[m], gates[m])):
            r = m // sum_rows * groups + j // per_group
            o_1F = out[r:r + 1]
            if m % sum_rows == 0 and j % per_group == 0:  # the row's first term: beta = 0
                torch.addmm(o_1F, x_1D, w_EDF[e], beta=0, alpha=g, out=o_1F)
            else:
                o_1F.addmm_(x_1D, w_EDF[e], alpha=g)
    return out if groups == 1 else out.view(M // sum_rows, groups, Fo)


class AllKernel(WholeKernel):
    """Gated, the gates are scattered into a dense [rows, groups, E] matrix (zero for the
    experts a row did not select), so the pick, the gate weighting and the sums are matmuls:
        groups = 1:  y[t] = Σ_{r,e} g[t·R + r, e] · x[t·R + r] W_e = z[t] · W.view(E·D, F),
                     z[t, e] = Σ_r g[t·R + r, e] · x[t·R + r]  (R = sum_rows; one GEMM)
        groups > 1:  y[m, g] = Σ_e g[m, g, e] · (x_m W_e)      (after the E products)"""

    name = "all"

    def run(self, x_MD, idx_MK, w_EDF, gates_MK, *, groups, sum_rows, plan, batch):
        M, K = idx_MK.shape
        E, D, Fo = w_EDF.shape
        if gates_MK is None:
            all_EMF = torch.matmul(x_MD, w_EDF)
            return all_EMF[idx_MK.long(), torch.arange(M, device=x_MD.device)[:, None]]
        dense_MGE = dense_gates(idx_MK.reshape(M, groups, K // groups),
                                gates_MK.reshape(M, groups, K // groups), E, x_MD)
        if groups > 1:  # (sum_rows is 1: validated)
            return torch.einsum("mge,emf->mgf", dense_MGE, torch.matmul(x_MD, w_EDF))
        T = M // sum_rows
        z_TED = torch.einsum("tre,trd->ted", dense_MGE.view(T, sum_rows, E),
                             x_MD.reshape(T, sum_rows, D))
        return z_TED.reshape(T, E * D) @ w_EDF.reshape(E * D, Fo)


def gated_sum_of_all(y_MGEF: torch.Tensor, idx_MGK: torch.Tensor,
                     gates_MGK: torch.Tensor) -> torch.Tensor:
    """The gated sum of the "all" kernel from products already computed (e.g. in a matmul
    fused with other projections of the same input): y_MGEF[m, g, e] is row m through expert e
    of group g, ``idx_MGK`` the K experts row m selected in group g (within the group) and
    ``gates_MGK`` their gates. Returns [M, G, F], Σ_k gates[m, g, k] · y[m, g, idx[m, g, k]]:
    the gates scattered into a dense [M, G, E] matrix (``dense_gates``) times y."""
    dense_MGE = dense_gates(idx_MGK, gates_MGK, y_MGEF.shape[2], y_MGEF)
    return torch.matmul(dense_MGE.unsqueeze(-2), y_MGEF).squeeze(-2)


def gated_group_sum_all(x_TGC: torch.Tensor, idx_TGK: torch.Tensor, gates_TGK: torch.Tensor,
                        w_XCF: torch.Tensor) -> torch.Tensor:
    """Σ_g Σ_k gates[t, g, k] · x[t, g] W[g·E + idx[t, g, k]], [T, F], for a few rows: each
    group g of x routes over its own E experts (``idx`` within the group; W stacks the G·E
    matrices group-major, [G·E, C, F]). The gates scattered into a dense [T, G, E] matrix times
    x give every (group, expert) input at once, then one GEMM with every matrix: the "all"
    layout of ``expert_matmul(..., sum_rows=G)`` without its id-space detour."""
    T, G, C = x_TGC.shape
    E = w_XCF.shape[0] // G
    dense_TGE = dense_gates(idx_TGK, gates_TGK, E, x_TGC)
    z_TGEC = dense_TGE.unsqueeze(-1) * x_TGC.unsqueeze(2)
    return z_TGEC.reshape(T, G * E * C) @ w_XCF.reshape(G * E * C, w_XCF.shape[-1])


register(PairsKernel())
register(AllKernel())

__all__ = ["AllKernel", "PairsKernel", "gated_group_sum_all", "gated_sum_of_all"]
