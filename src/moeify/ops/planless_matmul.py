"""The expert-matmul implementations that need no routing plan: the dense reference, the
gathered baseline and the two decoding layouts (``pairs``, ``all``). Each takes
``(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows)`` with the meaning of
moeify.ops.expert_matmul.expert_matmul, whose ``choose_impl`` decides when they run; autograd
does their backward.

Shape legend: M rows, K experts per row, E experts, D input width, F output width, G output
groups, R rows summed per output, T = M / R output rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _reference(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows=1):
    # Every row through every expert, then a one-hot pick: obviously correct, E times the work.
    all_MEF = torch.einsum("md,edf->mef", x_MD, w_EDF)
    onehot_MKE = F.one_hot(idx_MK.long(), w_EDF.shape[0]).to(x_MD.dtype)
    y_MKF = torch.einsum("mef,mke->mkf", all_MEF, onehot_MKE)
    return sum_rows_(combine(y_MKF, gates_MK, groups), sum_rows)


def _gather(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows=1):
    M, K = idx_MK.shape
    w_NDF = w_EDF.index_select(0, idx_MK.reshape(-1).long())
    y_NF = torch.bmm(x_MD.repeat_interleave(K, 0).unsqueeze(1), w_NDF).squeeze(1)
    return sum_rows_(combine(y_NF.view(M, K, w_EDF.shape[-1]), gates_MK, groups), sum_rows)


def _pairs(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows=1):
    M, K = idx_MK.shape
    if M * K == 0:
        return _gather(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows)
    if gates_MK is not None and not (torch.is_grad_enabled() and (
            x_MD.requires_grad or w_EDF.requires_grad or gates_MK.requires_grad)):
        return _pairs_accumulate(x_MD, idx_MK.tolist(), w_EDF, gates_MK.tolist(), groups,
                                 sum_rows)
    return sum_rows_(_pairs_mm(x_MD, idx_MK, w_EDF, gates_MK, groups), sum_rows)


def _pairs_accumulate(x_MD, ids, w_EDF, gates, groups, sum_rows):
    """``_pairs_mm`` without autograd (decoding): each pair is one matmul that adds its
    gate-weighted product into its output row, alpha = the gate (gate, group and row sums
    inside the BLAS call; no per-pair products, no concatenation)."""
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


def _pairs_mm(x_MD, idx_MK, w_EDF, gates_MK, groups):
    M, K = idx_MK.shape
    ids = idx_MK.tolist()
    rows, mats = x_MD.unsqueeze(1).unbind(0), w_EDF.unbind(0)  # views: one op each
    y_NF = torch.cat([torch.mm(rows[m], mats[e]) for m in range(M) for e in ids[m]])
    return combine(y_NF.view(M, K, w_EDF.shape[-1]), gates_MK, groups)


def _all_experts(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows=1):
    """Every row through every expert. Gated, with the gates scattered into a dense
    [rows, groups, E] matrix (zero for the experts a row did not select), so the pick, the
    gate weighting and the sums are matmuls too:
        groups = 1:  y[t] = Σ_{r,e} g[t·R + r, e] · x[t·R + r] W_e = z[t] · W.view(E·D, F),
                     z[t, e] = Σ_r g[t·R + r, e] · x[t·R + r]  (R = sum_rows; one GEMM)
        groups > 1:  y[m, g] = Σ_e g[m, g, e] · (x_m W_e)      (after the E products)"""
    M, K = idx_MK.shape
    E, D, Fo = w_EDF.shape
    if gates_MK is None:
        all_EMF = torch.matmul(x_MD, w_EDF)
        return all_EMF[idx_MK.long(), torch.arange(M, device=x_MD.device)[:, None]]
    dense_MGE = dense_gates(idx_MK.reshape(M, groups, K // groups),
                            gates_MK.reshape(M, groups, K // groups), E, x_MD)
    if groups > 1:  # (sum_rows is 1: _validate)
        return torch.einsum("mge,emf->mgf", dense_MGE, torch.matmul(x_MD, w_EDF))
    T = M // sum_rows
    z_TED = torch.einsum("tre,trd->ted", dense_MGE.view(T, sum_rows, E),
                         x_MD.reshape(T, sum_rows, D))
    return z_TED.reshape(T, E * D) @ w_EDF.reshape(E * D, Fo)


def dense_gates(idx_MGK: torch.Tensor, gates_MGK: torch.Tensor, num_experts: int,
                like: torch.Tensor) -> torch.Tensor:
    """The gates scattered over every expert, [M, G, num_experts] in ``like``'s dtype and
    device: gates[m, g, k] at expert idx[m, g, k], zero where not selected (repeated ids add)."""
    M, G, _ = idx_MGK.shape
    dense_MGE = torch.zeros(M, G, num_experts, dtype=like.dtype, device=like.device)
    return dense_MGE.scatter_add_(2, idx_MGK.long(), gates_MGK.to(like.dtype))


def gated_sum_of_all(y_MGEF: torch.Tensor, idx_MGK: torch.Tensor,
                     gates_MGK: torch.Tensor) -> torch.Tensor:
    """The gated sum of ``_all_experts`` from products already computed (e.g. in a matmul
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


def combine(y_MKF, gates_MK, groups):
    """[M, K, F] products -> their gate-weighted sums over each of ``groups`` equal parts of K
    ([M, F] for one group, [M, G, F]); ungated: as they are."""
    if gates_MK is None:
        return y_MKF
    M, K, Fo = y_MKF.shape
    y = (y_MKF * gates_MK.to(y_MKF.dtype)[..., None]).view(M, groups, K // groups, Fo).sum(2)
    return y.squeeze(1) if groups == 1 else y


def sum_rows_(y_MF: torch.Tensor, sum_rows: int) -> torch.Tensor:
    """[M, F] -> the sums of every ``sum_rows`` consecutive rows, [M / R, F]."""
    if sum_rows == 1:
        return y_MF
    M, Fo = y_MF.shape
    return y_MF.view(M // sum_rows, sum_rows, Fo).sum(1)


# By name; expert_matmul.PLANLESS lists these names.
PLANLESS_FNS = {"reference": _reference, "gather": _gather, "pairs": _pairs,
                "all": _all_experts}
