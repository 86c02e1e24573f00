"""The per-expert loop: the sorted rows of each expert through one torch.mm (CUTLASS-free and
obviously correct; on CPU one parallel region per expert)."""

from __future__ import annotations

import torch

from moeify.ops.moe.registry import ExpertKernel, register


class SegmentKernel(ExpertKernel):
    name = "segment"

    def forward(self, a, w_EAB, lay, k=None):
        a_PA = self.slot_rows(a, lay, k)
        out = a_PA.new_empty(a_PA.shape[0], w_EAB.shape[-1])
        start = 0
        for e, c in enumerate(lay.plan.counts()):
            if c:
                torch.mm(a_PA[start:start + c], w_EAB[e], out=out[start:start + c])
            start += c
        return out

    def weight_grad(self, a, g_PB, lay, n_experts, k=None):
        a_PA = self.slot_rows(a, lay, k)
        out = a_PA.new_zeros(n_experts, a_PA.shape[1], g_PB.shape[1])
        start = 0
        for e, c in enumerate(lay.plan.counts()):
            if c:
                torch.mm(a_PA[start:start + c].t(), g_PB[start:start + c], out=out[e])
            start += c
        return out


register(SegmentKernel())
