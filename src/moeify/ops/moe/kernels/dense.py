"""The kernels that need no routing plan: the dense reference, the gathered baseline and the
two decoding layouts. Each runs the whole expert-matmul contract with differentiable torch ops
(autograd does their backward); the policy (moeify.ops.moe.policy) decides when they run.

    reference  dense and obviously correct: x @ w for every expert, then a one-hot pick;
               float64-safe.
    gather     per-row gathered batched matmul, w[idx] -> [N, D, F]; the naive baseline.
    pairs      one small matmul per routed (row, expert) pair against a view of that expert's
               matrix: reads only the routed matrices and copies none (decoding at batch 1).
    all        every row through every expert in one batched matmul, the routed products picked
               (gated: the gates scattered over all experts, so pick and sums are matmuls):
               E/K times the multiply-adds, but each matrix read once and nothing sorted
               (batched decoding).

Shape legend: M rows, K experts per row, E experts, D input width, F output width, G output
groups, R rows summed per output, T = M / R output rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeify.ops.moe.combine import combine
from moeify.ops.moe.registry import WholeKernel, register


class ReferenceKernel(WholeKernel):
    name = "reference"

    def run(self, x_MD, idx_MK, w_EDF, gates_MK, *, groups, sum_rows, plan, batch):
        all_MEF = torch.einsum("md,edf->mef", x_MD, w_EDF)
        onehot_MKE = F.one_hot(idx_MK.long(), w_EDF.shape[0]).to(x_MD.dtype)
        y_MKF = torch.einsum("mef,mke->mkf", all_MEF, onehot_MKE)
        return combine(y_MKF.reshape(-1, w_EDF.shape[-1]), gates_MK, idx_MK.shape[1], groups,
                       sum_rows)


class GatherKernel(WholeKernel):
    name = "gather"

    def run(self, x_MD, idx_MK, w_EDF, gates_MK, *, groups, sum_rows, plan, batch):
        K = idx_MK.shape[1]
        w_NDF = w_EDF.index_select(0, idx_MK.reshape(-1).long())
        y_NF = torch.bmm(x_MD.repeat_interleave(K, 0).unsqueeze(1), w_NDF).squeeze(1)
        return combine(y_NF, gates_MK, K, groups, sum_rows)


class PairsKernel(WholeKernel):
    name = "pairs"

    def run(self, x_MD, idx_MK, w_EDF, gates_MK, *, groups, sum_rows, plan, batch):
        M, K = idx_MK.shape
        if M * K == 0:
            return _GATHER.run(x_MD, idx_MK, w_EDF, gates_MK, groups=groups,
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


def dense_gates(idx_MGK: torch.Tensor, gates_MGK: torch.Tensor, num_experts: int,
                like: torch.Tensor) -> torch.Tensor:
    """The gates scattered over every expert, [M, G, num_experts] in ``like``'s dtype and
    device: gates[m, g, k] at expert idx[m, g, k], zero where not selected (repeated ids add)."""
    M, G, _ = idx_MGK.shape
    dense_MGE = torch.zeros(M, G, num_experts, dtype=like.dtype, device=like.device)
    return dense_MGE.scatter_add_(2, idx_MGK.long(), gates_MGK.to(like.dtype))


register(ReferenceKernel())
_GATHER = register(GatherKernel())
register(PairsKernel())
register(AllKernel())
