"""torch's grouped GEMM (``torch.nn.functional.grouped_mm``) over the rows sorted by expert:
one kernel launch for every expert, sized from the device-side offsets (no host sync)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeify.ops.moe.registry import ExpertKernel, register

HAS_GROUPED_MM = hasattr(F, "grouped_mm")


def grouped_ok(*tensors: torch.Tensor) -> bool:
    """grouped_mm's preconditions: no float64, row strides multiples of 16 bytes."""
    for t in tensors:
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        if (t.shape[-1] * t.element_size()) % 16:
            return False
    return True


class GroupedKernel(ExpertKernel):
    name = "grouped"

    def unavailable(self, x, w):
        if not HAS_GROUPED_MM:
            return "this torch has no torch.nn.functional.grouped_mm"
        if not grouped_ok(x, w):
            return ("grouped_mm needs float32, float16 or bfloat16 rows whose widths are "
                    "multiples of 16 bytes")
        return None

    def forward(self, a, w_EAB, lay, k=None):
        a_PA = self.slot_rows(a, lay, k).contiguous()
        return F.grouped_mm(a_PA, w_EAB, offs=lay.plan.offsets_E)

    def weight_grad(self, a, g_PB, lay, n_experts, k=None):
        a_PA = self.slot_rows(a, lay, k)
        return F.grouped_mm(a_PA.t(), g_PB.contiguous(), offs=lay.plan.offsets_E)


register(GroupedKernel())
