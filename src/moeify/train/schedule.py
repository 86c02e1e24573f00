"""Learning-rate schedule: linear warm-up, then cosine decay (switchhead.md §3).

The paper: "cosine schedule with T_max = 100k steps, offset by a linear warm-up of 4000 steps"
(262M-class models; no warm-up for the small ones). The factor multiplies the base lr; update
number s (0-based) uses factor(s):

    s < W:   (s + 1) / W                                     linear warm-up, never exactly 0
    s >= W:  r + (1 - r) * (1 + cos(pi * min(s - W, T) / T)) / 2

with W the warm-up steps, T the cosine's T_max and r the floor ratio (0 in the paper, as
torch's CosineAnnealingLR with eta_min = 0).
"""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, *, warmup_steps: int, cosine_steps: int,
              min_lr_ratio: float = 0.0) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t = min(step - warmup_steps, cosine_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t / cosine_steps))


def cosine_steps_of(cfg) -> int:
    """The cosine's T_max for a TrainConfig: ``cosine_steps`` or the steps after the warm-up."""
    if cfg.cosine_steps is not None:
        return cfg.cosine_steps
    return max(1, cfg.steps - cfg.warmup_steps)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    T = cosine_steps_of(cfg)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup_steps=cfg.warmup_steps, cosine_steps=T,
                                       min_lr_ratio=cfg.min_lr_ratio))
