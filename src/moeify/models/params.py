"""Parameter counts of a model or layer config, on the meta device: the real modules are
constructed, so the count is the count of the model that trains, but no weight is ever
allocated."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moeify.models.lm import TransformerLM, build_block

if TYPE_CHECKING:
    from moeify.models.config import ModelConfig


def count_module_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def layer_parameters(cfg: Any) -> int:
    """Parameters of the module a layer config builds, built on the meta device."""
    with torch.device("meta"):
        return count_module_parameters(cfg.build())


def model_parameters(config: "ModelConfig") -> dict[str, int]:
    """Parameter counts of a TransformerLM built from ``config``, split into embedding, output,
    attention, feedforward, norms (the LayerNorms) and other (depth routers, ...), plus total.

    Built on the meta device; a layer that repeats (same attention, feedforward and depth
    config) is built once and counted as often as it occurs. With MoEUT's grouping
    (group_size G) only the G distinct blocks hold parameters; with Mixture-of-Recursions the
    whole model is built (on the meta device) and its shared stack counted once, its routers
    under "other"."""
    class _Shell(TransformerLM):  # the model without its blocks: embedding, final LN, output
        def _build_blocks(self, config):
            return nn.ModuleList()

    parts = dict.fromkeys(("embedding", "attention", "feedforward", "norms", "output", "other"),
                          0)
    with torch.device("meta"):
        if config.recursion is not None:
            _add_parts(parts, TransformerLM(config), "", 1)
            parts["total"] = sum(parts.values())
            return parts
        _add_parts(parts, _Shell(config), "", 1)
        layers = list(zip(config.attention_layers(), config.feedforward_layers(),
                          config.depth_layers()))[:config.n_blocks]
        unique: list[tuple] = []  # by equality: layer configs need not be hashable
        for key in layers:
            if key not in unique:
                unique.append(key)
        for key in unique:
            _add_parts(parts, build_block(config, *key), "blocks.0.", layers.count(key))
    parts["total"] = sum(parts.values())
    return parts


def _add_parts(parts: dict[str, int], module: nn.Module, prefix: str, times: int) -> None:
    for name, p in module.named_parameters():
        name = prefix + name
        if name.startswith("embedding.") or name.startswith("pos_embedding."):
            part = "embedding"
        elif name.startswith("output."):
            part = "output"
        elif ".attention." in name:
            part = "attention"
        elif ".feedforward." in name:
            part = "feedforward"
        elif name.startswith("ln_f.") or ".ln1." in name or ".ln2." in name:
            part = "norms"
        else:
            part = "other"
        parts[part] += times * p.numel()
