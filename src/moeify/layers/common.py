"""What every routed layer returns beside its output, and its training-only usage buffers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Aux:
    """Auxiliary outputs of a layer, returned (never stored in globals).

    losses: scalar tensors already multiplied by their coefficients, ready to add to the LM loss
            (a loss is present whenever its coefficient is non-zero).
    stats:  detached routing statistics (tokens per expert, entropy, fraction dropped, ...).
    """

    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)

    def update(self, other: "Aux", prefix: str = "") -> "Aux":
        for k, v in other.losses.items():
            self.losses[prefix + k] = v
        for k, v in other.stats.items():
            self.stats[prefix + k] = v
        return self

    def total_loss(self) -> torch.Tensor | None:
        return sum(self.losses.values()) if self.losses else None


def register_usage(module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
    """Create the running per-expert count buffer ``name``: int64 (so model.to(dtype) leaves it
    exact), not saved in checkpoints."""
    module.register_buffer(name, torch.zeros(shape, dtype=torch.int64), persistent=False)


def accumulate_usage(module: nn.Module, name: str, counts: torch.Tensor) -> None:
    """Add ``counts`` to the buffer made by ``register_usage``, in training mode only: evaluation
    never changes the running statistics."""
    if module.training:
        c = counts.detach()
        getattr(module, name).add_((c.round() if c.is_floating_point() else c).long())
