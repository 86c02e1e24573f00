"""MoSA presets (Piękos, Csordás, Schmidhuber 2025, arXiv 2505.00315): the paper compares MoSA
with dense attention at equal compute, spending what the sparse heads save on more heads,
and keeps a few dense heads beside the sparse ones (the hybrid).

``tiny-mosa`` and ``repro-mosa`` replace the 4-head (tiny) / 8-head (repro) dense RoPE attention
by 32 MoSA heads of d_h = 32 with sparsity rho = 8 (k = 16 of T = 128 tokens) plus one dense head
of d_h = 32: their attention MACs per layer equal the dense model's exactly under
moeify.models.cost (12,582,912 MACs; tests/models/test_mosa_presets.py), the paper's
compute-matched comparison. They have more parameters than the dense model, as the paper's
compute-matched MoSA models do.

No preset reproduces a row of the paper's tables, because no table of the paper could be read
here: the stored copies of arXiv 2505.00315 (abstract and HTML pages) hold only its opening and
method, summaries of it hold no configuration, and the authors' repository (piotrpiekos/MoSA)
holds the layer only, with no model configurations or parameter counts. No published
configuration is guessed.
"""

from __future__ import annotations

from moeify.layers.mosa import MoSAConfig
from moeify.models.builders import Size, dense_ff, lm
from moeify.models.config import ModelConfig
from moeify.models.registry import Preset

TINY_ROPE = Size(vocab=256, d=128, L=4, T=128,
                 xl=False, dropout=0.0, dense_heads=4, dense_d_head=32, dense_d_ff=512)
REPRO_ROPE = Size(vocab=256, d=128, L=4, T=128,
                  xl=False, dropout=0.0, dense_heads=8, dense_d_head=16, dense_d_ff=512)


def mosa_attn(*, d: int, L: int, H: int, d_h: int, sparsity: int, dense_heads: int = 0,
              pos: str = "rope") -> MoSAConfig:
    return MoSAConfig(d_model=d, n_heads=H, d_head=d_h, sparsity=sparsity,
                      n_dense_heads=dense_heads, pos=pos, n_layers=L)


def mosa_lm(size: Size, *, H: int, d_h: int, sparsity: int, dense_heads: int,
            d_ff: int) -> ModelConfig:
    if size.xl:
        raise ValueError("MoSA is a RoPE model: build it on a Size without XL memory")
    return lm(size, mosa_attn(d=size.d, L=size.L, H=H, d_h=d_h, sparsity=sparsity,
                              dense_heads=dense_heads),
              dense_ff(d=size.d, L=size.L, d_ff=d_ff, dropout=size.dropout))


def tiny_mosa() -> ModelConfig:
    return mosa_lm(TINY_ROPE, H=32, d_h=32, sparsity=8, dense_heads=1, d_ff=512)


def repro_mosa() -> ModelConfig:
    return mosa_lm(REPRO_ROPE, H=32, d_h=32, sparsity=8, dense_heads=1, d_ff=512)


MOSA_PRESETS: tuple[Preset, ...] = (
    Preset("tiny-mosa", "tiny RoPE: MoSA 32 sparse heads d_h=32 rho=8 (k=16) + 1 dense head, "
           "dense FFN d_ff=512 (attention MACs of 4 dense heads)", tiny_mosa),
    Preset("repro-mosa", "CPU-scale family (RoPE, no memory): MoSA 32 sparse heads d_h=32 "
           "rho=8 + 1 dense head, d_ff=512, MAC-matched to repro-rope-dense", repro_mosa,
           baseline="repro-rope-dense"),
)
