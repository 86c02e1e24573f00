"""The kernels that need no routing plan and run on every device: the dense reference and the
gathered baseline. Each runs the whole expert-matmul contract with differentiable torch ops
(autograd does their backward). The CPU decoding layouts ("pairs", "all") live in
moeify.ops.moe.cpu.decoding; the dense-over-experts training kernel in
moeify.ops.moe.kernels.concat.

    reference  dense and obviously correct: x @ w for every expert, then a one-hot pick;
               float64-safe.
    gather     per-row gathered batched matmul, w[idx] -> [N, D, F]; the naive baseline.

Shape legend: M rows, K experts per row, E experts, D input width, F output width, G output
groups, R rows summed per output.
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


register(ReferenceKernel())
register(GatherKernel())
