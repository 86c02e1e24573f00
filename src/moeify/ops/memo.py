"""Stamps for values derived from weights and kept between calls (decoding's distance table,
fused projection weights): a kept value is reused only while every tensor it came from has the
same stamp."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake


def stamp(t: torch.Tensor) -> tuple | None:
    """What identifies a tensor's current values: its storage, layout and version counter (which
    every in-place update, an optimizer step or ``load_state_dict``, increments). None for
    tensors that cannot be stamped (inference tensors keep no version counter): derive afresh."""
    if t.is_inference():
        return None
    # A fake tensor (the cost contract's, moeify.bench.contract) has no data pointer: its
    # storage's identity and offset stand in.
    ptr = ((t.untyped_storage()._cdata, t.storage_offset()) if is_fake(t) else t.data_ptr())
    return (ptr, t._version, tuple(t.shape), t.stride(), t.dtype, t.device)


def stamps(*ts: torch.Tensor) -> tuple | None:
    """The stamps of several tensors, or None if any cannot be stamped."""
    out = tuple(stamp(t) for t in ts)
    return None if any(s is None for s in out) else out
