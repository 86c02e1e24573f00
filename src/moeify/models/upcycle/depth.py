"""A plain block -> Mixture-of-Depths around it (layers/depth.py).

MoD updates a routed token as x + r · (f(x) - x), r = wᵀx + b its router logit. The conversion
sets b = 1 and w = router_scale times a fresh router draw, so r is about 1 and a routed token
gets about f(x), the plain block's output.
    Preserves: with capacity 1 and router_scale = 0 every token is routed with r = 1 exactly,
    so the wrapper equals the plain block (up to the rounding of x + (f(x) - x)): exact.
    With capacity < 1 only ceil(capacity · T) tokens per sequence enter the block, chosen by
    the small random router at first; the others skip it, and the routed ones attend only to
    each other. That gap is what training must close; tests report it.
"""

from __future__ import annotations

import torch

from moeify.layers.block import TransformerBlock
from moeify.layers.common import init_scale
from moeify.layers.depth import MixtureOfDepths, MoDConfig
from moeify.models.upcycle.common import generator, small_router


def to_mod(block: TransformerBlock, *, d_model: int, n_layers: int, capacity: float,
           router_scale: float = 0.1, aux_coef: float = 0.01, causal_router: str = "aux_bce",
           seed: int = 0) -> MixtureOfDepths:
    """``block`` (its weights shared, not copied) wrapped in Mixture-of-Depths routing."""
    if not isinstance(block, TransformerBlock):
        raise ValueError(f"mod: only a plain block can be wrapped, got {type(block).__name__} "
                         "(is it already depth-routed?)")
    cfg = MoDConfig(d_model=d_model, capacity=capacity, causal_router=causal_router,
                    aux_coef=aux_coef, n_layers=n_layers)
    out = MixtureOfDepths(cfg, block)
    with torch.no_grad():
        out.w_router.copy_(small_router((d_model,), init_scale(n_layers) / d_model ** 0.5,
                                        router_scale, generator(seed)))
        out.bias_router.fill_(1.0)  # r = 1: a routed token gets f(x) (module docstring)
    return out
