"""The output layer and the LM loss in one: mean cross-entropy of (h Wᵀ + b) without keeping the
logits.

    loss = masked_mean(CE(h_ND W_VDᵀ + b_V, targets_N), valid_N)          (reference)

Shape legend: N tokens (rows), D hidden width, V vocabulary, R rows of one chunk.

The reference materialises [N, V] logits and autograd keeps them twice more (the log-softmax
output, then its gradient and the logits' gradient during backward): at N = 1024, V = 8000 that
is 31 MiB each. The fused path walks the rows in chunks of R and, since the loss is a scalar,
computes the gradients in the forward pass: per chunk
    z_RV  = h_RD W_VDᵀ + b_V
    ce_R  = logsumexp(z_RV) - z_RV[target]             (max-shifted, in place in z)
    dz_RV = (softmax(z_RV) - onehot(target)) · w_R / n        w_R = valid (or 1), n = Σ w
    dh_RD = dz_RV W_VD,   dW_VD += dz_RVᵀ h_RD,   db_V += Σ_R dz_RV
so nothing V wide outlives a chunk, and backward only scales dh, dW, db by the incoming
gradient. Same multiply-adds as the reference's forward and backward (no recomputation).
Results equal the reference's up to float rounding (the tests hold the fused path to it in
float64 and float32). Double backward is not supported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moeify.ops.amp import amp_backward, amp_forward
from moeify.ops.aux_losses import masked_mean

IMPLS = ("auto", "fused", "reference")
CHUNK_ELEMENTS = 2 ** 21  # R·V per chunk: 8 MiB of float32 logits


def reference_linear_cross_entropy(h_ND, w_VD, b_V, targets_N, valid_N=None) -> torch.Tensor:
    """The output layer, then cross-entropy in at least float32 and the (masked) mean."""
    z_NV = F.linear(h_ND, w_VD, b_V)
    z_NV = z_NV.to(torch.promote_types(z_NV.dtype, torch.float32))
    ce_N = F.cross_entropy(z_NV, targets_N, reduction="none")
    return masked_mean(ce_N, valid_N)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    @amp_forward
    def forward(ctx, h_ND, w_VD, b_V, targets_N, valid_N, rows: int):
        N, V = h_ND.shape[0], w_VD.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        wts_N = None if valid_N is None else valid_N.to(h_ND.dtype)
        n = h_ND.new_tensor(float(N)) if wts_N is None else wts_N.sum().clamp_min(1.0)
        total = h_ND.new_zeros(())
        dh_ND = torch.empty_like(h_ND) if need_h else None
        dw_VD = torch.zeros_like(w_VD) if need_w else None
        db_V = torch.zeros_like(b_V) if need_b else None
        z_buf = h_ND.new_empty(min(rows, N), V)  # one buffer for every chunk's logits
        for s in range(0, N, rows):
            h_RD, t_R = h_ND[s:s + rows], targets_N[s:s + rows]
            z_RV = z_buf[:len(t_R)]
            if b_V is None:
                torch.mm(h_RD, w_VD.t(), out=z_RV)
            else:
                torch.addmm(b_V, h_RD, w_VD.t(), out=z_RV)
            # logsumexp and softmax in place in z: nothing else R x V wide is allocated
            zt_R = z_RV.gather(1, t_R[:, None])[:, 0]
            max_R = z_RV.amax(1)
            sum_R = z_RV.sub_(max_R[:, None]).exp_().sum(1)
            ce_R = max_R + sum_R.log() - zt_R
            total += ce_R.sum() if wts_N is None else (ce_R * wts_N[s:s + rows]).sum()
            scale_R = (1.0 / n).expand(len(t_R)) if wts_N is None else wts_N[s:s + rows] / n
            dz_RV = z_RV.mul_((scale_R / sum_R)[:, None])  # softmax · w/n
            dz_RV[torch.arange(len(t_R), device=t_R.device), t_R] -= scale_R
            if need_h:
                torch.mm(dz_RV, w_VD, out=dh_ND[s:s + rows])
            if need_w:
                dw_VD.addmm_(dz_RV.t(), h_RD)
            if need_b:
                db_V += dz_RV.sum(0)
        ctx.grads = (dh_ND, dw_VD, db_V)
        return total / n

    @staticmethod
    @amp_backward
    @once_differentiable
    def backward(ctx, g):
        grads = ctx.grads
        del ctx.grads  # hand the tensors over: AccumulateGrad can then keep them without a copy
        return (*(None if t is None else t.mul_(g) for t in grads), None, None, None)


def fused_applies(h_ND: torch.Tensor, w_VD: torch.Tensor) -> bool:
    """What "auto" fuses: float32 without autocast (the precision the reference's loss is
    computed in; "fused" also runs float64, in float64)."""
    return (h_ND.dtype == w_VD.dtype == torch.float32
            and not torch.is_autocast_enabled(h_ND.device.type))


def linear_cross_entropy(h_ND: torch.Tensor, w_VD: torch.Tensor, b_V: torch.Tensor | None,
                         targets_N: torch.Tensor, valid_N: torch.Tensor | None = None, *,
                         impl: str = "auto", chunk_rows: int | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of the output layer (module docstring), a float32 scalar
    for float32 inputs. "auto": the fused path when gradients are being recorded and
    ``fused_applies``, else the reference (which keeps nothing without gradients)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown linear_cross_entropy impl {impl!r}; choose from "
                         f"{', '.join(IMPLS)}")
    fused = impl == "fused" or (impl == "auto" and torch.is_grad_enabled()
                                and fused_applies(h_ND, w_VD))
    if not fused:
        return reference_linear_cross_entropy(h_ND, w_VD, b_V, targets_N, valid_N)
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // w_VD.shape[0])
    return _FusedLinearCE.apply(h_ND, w_VD, b_V, targets_N, valid_N, rows)
