"""Normalisation layers: LayerNorm (with or without bias) and RMSNorm, as one small config.

    layernorm  y = (x - mean(x)) / sqrt(var(x) + eps) · w (+ b)      (Ba et al. 2016; GPT-2)
    rmsnorm    y = x / sqrt(mean(x²) + eps) · w                       (Zhang & Sennrich 2019;
                                                                        Llama, Mistral, Qwen2)

The default, ``NormConfig()``, is the LayerNorm with bias and eps 1e-5 of the papers' models.
RMSNorm is computed in float32 whatever the input dtype, as Llama's reference code does, and cast
back. Shape legend: D d_model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

NORM_KINDS = ("layernorm", "rmsnorm")


@dataclass(frozen=True, kw_only=True)
class NormConfig:
    """kind: "layernorm" or "rmsnorm"; eps: added to the variance (mean square);
    bias: LayerNorm's additive bias (RMSNorm has none)."""

    kind: str = "layernorm"
    eps: float = 1e-5
    bias: bool = True

    def __post_init__(self) -> None:
        if self.kind not in NORM_KINDS:
            raise ValueError(f"NormConfig.kind must be one of {', '.join(NORM_KINDS)}, "
                             f"got {self.kind!r}")
        if not self.eps > 0:
            raise ValueError(f"NormConfig.eps must be positive, got {self.eps}")
        if self.kind == "rmsnorm" and self.bias:
            raise ValueError("NormConfig: RMSNorm has no bias; set bias=False")

    def build(self, d_model: int) -> nn.Module:
        if self.kind == "layernorm":
            return nn.LayerNorm(d_model, eps=self.eps, bias=self.bias)
        return RMSNorm(d_model, eps=self.eps)


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x32 = x_BTD.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x_BTD.dtype)



__all__ = ["NORM_KINDS", "NormConfig", "RMSNorm"]
