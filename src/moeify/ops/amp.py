"""Autocast and moeify's custom autograd Functions: one rule, applied to every Function in ops.

Autocast decides per ATen op what precision it runs in, and the policies differ by device: on
CUDA ``sum``, ``softmax``, ``exp`` and other reductions run in float32 and return float32, on
the CPU they keep bf16. A custom Function's forward called under autocast runs its ops under
that policy too, so a forward written for one dtype can return a float32 output on CUDA while it
saved bf16 operands; autograd then hands its backward a float32 gradient, and the backward's
matmul of that gradient with a saved bf16 weight fails (``expected mat1 and mat2 to have the same
dtype``), on CUDA only.

The rule, enforced by the two decorators below:
- the caller casts the operands to the autocast dtype before ``apply`` (``autocast_cast``: the
  matmul policy of autocast, which a Function is invisible to);
- the forward runs with autocast off (``amp_forward``): its ops run in the operands' dtype on
  every device, so what it returns and what it saves agree;
- the backward casts each incoming gradient to the dtype of the output it belongs to
  (``amp_backward``), so that a gradient of another dtype (handed over by a caller of the graph
  node, or by a future autograd that no longer casts) never reaches a matmul.
"""

from __future__ import annotations

import contextlib
import functools

import torch


def _device_type(args) -> str | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return None


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype on ``device_type`` while autocast is on there, else None."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_cast(*tensors: torch.Tensor | None) -> tuple:
    """The floating tensors cast to the autocast dtype of their device when autocast is on there
    (what autocast does to a matmul's operands); None and non-floating tensors unchanged."""
    dev = _device_type(tensors)
    dt = None if dev is None else autocast_dtype(dev)
    if dt is None:
        return tensors
    return tuple(t.to(dt) if t is not None and t.is_floating_point() else t for t in tensors)


def autocast_off(device_type: str):
    """A context with autocast off on ``device_type`` (nothing to do when it is off already).
    The composite paths of an op run in it after ``autocast_cast``, so that every implementation
    returns the autocast dtype on every device, as the Functions do."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def amp_forward(forward):
    """Decorates a Function's ``forward(ctx, *args)``: it runs with autocast off on the device of
    its first tensor argument, and the dtypes of its outputs are kept for ``amp_backward``."""

    @functools.wraps(forward)
    def wrapper(ctx, *args):
        dev = _device_type(args)
        if dev is not None and torch.is_autocast_enabled(dev):
            with torch.autocast(dev, enabled=False):
                out = forward(ctx, *args)
        else:
            out = forward(ctx, *args)
        outs = out if isinstance(out, tuple) else (out,)
        ctx.amp_out_dtypes = tuple(o.dtype if isinstance(o, torch.Tensor) else None
                                   for o in outs)
        return out

    return wrapper


def amp_backward(backward):
    """Decorates a Function's ``backward(ctx, *grads)``: each gradient arrives in the dtype of
    the output it belongs to (``amp_forward`` recorded them)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        dtypes = getattr(ctx, "amp_out_dtypes", ())
        grads = tuple(g.to(dt) if isinstance(g, torch.Tensor) and dt is not None
                      and g.dtype != dt else g
                      for g, dt in zip(grads, dtypes + (None,) * (len(grads) - len(dtypes))))
        return backward(ctx, *grads)

    return wrapper


__all__ = ["amp_backward", "amp_forward", "autocast_cast", "autocast_dtype", "autocast_off"]
