"""Every MoE family x every expert-matmul implementation, forced: the cases and their tiny models
(tests/models/test_every_impl_trains.py on the CPU, tests/train/test_cuda.py on a GPU)."""

import torch

from moeify.models.presets import get_preset
from moeify.ops.moe import IMPLEMENTATIONS
from moeify.train.config import apply_model_overrides

# Which parts of each family route through the expert matmul.
FAMILIES = {"tiny-switchhead": ("attention",), "tiny-moa": ("attention",),
            "tiny-sigmamoe": ("feedforward",), "tiny-switch": ("feedforward",),
            "tiny-switchall": ("attention", "feedforward"), "tiny-mode": ("feedforward",)}
IMPLS = IMPLEMENTATIONS + ("auto",)


def every_impl_cases(device: str = "cpu"):
    for preset in FAMILIES:
        for impl in IMPLS:
            if impl == "sets" and preset not in ("tiny-switchhead", "tiny-switchall"):
                continue  # the set layout is SwitchHead's (experts in per-head groups)
            if impl == "triton" and device != "cuda":
                continue  # CUDA kernels (tests/ops/test_triton_matmul.py: the CPU interpreter)
            yield preset, impl


def every_impl_model(preset, impl):
    """(config, model in training mode, seed 0) of ``preset`` at 2 layers and 16 tokens with
    ``impl`` forced in every part that routes through the expert matmul ("sets" only where the
    layer routes in groups, SwitchHead: the sigma-MoE of SwitchAll keeps "auto" then)."""
    overrides = ["model.n_layers=2", "model.context_length=16"]
    for part in FAMILIES[preset]:
        if impl != "sets" or part == "attention":
            overrides.append(f"model.{part}.expert_impl={impl}")
    cfg = apply_model_overrides(get_preset(preset), overrides)
    torch.manual_seed(0)
    return cfg, cfg.build().train()
