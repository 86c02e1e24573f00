"""Dropout that keeps less for backward, with the same masks and results as torch's.

    dropout(x, p, training)        = F.dropout(x, p, training)
    relu_dropout(x, p, training)   = F.dropout(F.relu(x), p, training)

What autograd keeps for backward, per element of x:
                      reference (F.dropout on CPU)          "fast"
    dropout           the float mask/(1-p) (4 bytes)         a bool mask (1 byte)
    relu_dropout      ReLU's output + the float mask (8 B)   the output y only (0 B when the next
                                                             layer saves y anyway, as a Linear does)

relu_dropout's gradient needs no mask: y > 0 exactly where x > 0 and the unit was kept (y = x /
(1-p) >= x there), so dx = where(y > 0, dy · s, 0) with s the kept units' scale. The forward
runs torch's own dropout, so the random stream, the masks and the outputs are torch's; the
backward multiplies by the very float scale torch multiplies by, so the gradients are torch's
too (the tests compare both, bit for bit, against the reference).

Plain ``dropout`` rebuilds torch's CPU recipe (``noise = bernoulli(1-p) / (1-p); y = x · noise``:
the same draws from the generator) to see its mask; on other devices torch's fused kernel
already keeps a bool mask, so "auto" takes the reference there.

impl: "auto" (the fast path where it applies), "fast" or "reference".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeify.ops.amp import amp_backward, amp_forward

IMPLS = ("auto", "fast", "reference")


def _check(p: float, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"unknown dropout impl {impl!r}; choose from {', '.join(IMPLS)}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")


def _kept_scale(p: float, like: torch.Tensor) -> torch.Tensor:
    """1/(1-p) computed as torch's dropout computes the kept units' value (ones / (1-p))."""
    return torch.ones((), dtype=like.dtype, device=like.device).div_(1 - p)


class _MaskDropout(torch.autograd.Function):
    @staticmethod
    @amp_forward
    def forward(ctx, x, p: float):
        noise = torch.empty_like(x).bernoulli_(1 - p)  # torch's CPU recipe, same draws
        keep = noise.bool()
        noise.div_(1 - p)
        ctx.p = p
        ctx.save_for_backward(keep)
        return x * noise

    @staticmethod
    @amp_backward
    def backward(ctx, g):
        (keep,) = ctx.saved_tensors
        return g * keep.to(g.dtype).div_(1 - ctx.p), None


class _ReluDropout(torch.autograd.Function):
    @staticmethod
    @amp_forward
    def forward(ctx, x, p: float):
        y = F.dropout(F.relu(x), p, True)
        ctx.p = p
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @amp_backward
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        # = where(y > 0, g · s, 0), with one temporary as large as g instead of two
        return torch.where(y > 0, g, 0.0).mul_(_kept_scale(ctx.p, g)), None


def _active(p: float, training: bool) -> bool:
    return training and 0.0 < p < 1.0


def dropout(x: torch.Tensor, p: float, training: bool = True, *,
            impl: str = "auto") -> torch.Tensor:
    """``F.dropout(x, p, training)``; "fast" keeps a bool mask for backward (module docstring)."""
    _check(p, impl)
    fast = impl == "fast" or (impl == "auto" and x.device.type == "cpu")
    if not fast or not _active(p, training) or not torch.is_grad_enabled():
        return F.dropout(x, p, training)
    return _MaskDropout.apply(x, p)


def relu_dropout(x: torch.Tensor, p: float, training: bool = True, *,
                 impl: str = "auto") -> torch.Tensor:
    """``F.dropout(F.relu(x), p, training)``; "fast"/"auto" keep only the output for backward."""
    _check(p, impl)
    if impl == "reference" or not _active(p, training) or not torch.is_grad_enabled():
        return F.dropout(F.relu(x), p, training)
    return _ReluDropout.apply(x, p)
