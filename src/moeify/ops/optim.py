"""The AdamW that training and the step benchmark build: torch's, with its fused kernel where
torch has one.

torch's default AdamW on CPU is the per-parameter loop ("foreach" kernels exist on GPUs only):
several passes over every parameter, with temporaries (the tensor-memory accounting of
moeify.bench.memory sees +360 MiB during the update at the 47M models, 47M parameters).
``fused=True`` updates each parameter in one pass without temporaries: measured 4-5x faster
than the loop on two CPU threads at 47M parameters (the fused kernel also beats "foreach"). It
computes the same update (the tests compare the implementations over several steps, with and
without weight decay, to float rounding). Parameters torch's fused kernel does not take (sharded
DTensor parameters, devices other than CPU and CUDA) get torch's default.

A checkpoint keeps the optimizer's settings: resuming one written by torch's default AdamW goes
on with that implementation (torch's ``load_state_dict`` restores the saved flags), so a resumed
run is still bit-identical to the uninterrupted one.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch._subclasses.fake_tensor import is_fake

IMPLS = ("auto", "fused", "default")
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fused_supported(params: Iterable[torch.Tensor]) -> bool:
    """Whether every parameter is a plain floating tensor on CPU or CUDA (or a fake one, which
    stands for it where the cost contract counts a whole training step: moeify.bench.contract)."""
    return all((type(p.detach()) is torch.Tensor or is_fake(p))
               and p.device.type in ("cpu", "cuda") and p.dtype in _FUSED_DTYPES for p in params)


def adamw(param_groups, *, lr: float, betas: tuple[float, float], weight_decay: float = 0.0,
          impl: str = "auto", foreach: bool | None = None) -> torch.optim.AdamW:
    """torch.optim.AdamW over ``param_groups`` (parameters or torch's group dicts): fused when
    ``impl="auto"`` and every parameter allows it (module docstring), or "fused"; "default":
    torch's own choice (the reference the tests compare against). ``foreach``: torch's
    argument, for the unfused implementation (None: torch's choice)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown AdamW impl {impl!r}; choose from {', '.join(IMPLS)}")
    groups = list(param_groups)
    params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = impl == "fused" or (impl == "auto" and fused_supported(params))
    return torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay,
                             fused=True if fused else None, foreach=None if fused else foreach)
