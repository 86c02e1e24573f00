"""A CPU-scale, parameter-matched family mirroring the SwitchHead paper's WT103 47M comparison
(Tables 1-3): dense with many heads, dense with 2 heads, SwitchHead, MoA and SwitchAll.

Shape: byte vocabulary (256; the trainer sets the tokenizer's), d = 128, L = 4, T = 128 with
one chunk of XL memory, no dropout (runs are far too short to overfit). The dense baseline has
8 heads of d_h = 16 (H·d_h = d, as the paper's 10 x 41 for d = 412); the 2-head baseline keeps
the total width (2 x 64), as the paper's 2 x 205.

SwitchHead follows spec §5: H·E equals the baseline's head count (H = 2, E = 4, k = 2), and
``moeify.models.match.match_attention`` picks d_head (28) and the d_ff that absorbs the
remainder. MoA is matched the same way with 4 selected heads of 8 (Table 1's best MoA has 4).
SwitchAll replaces the matched SwitchHead model's feedforward by a sigma-MoE of E·G = 512
(8 experts of 64, k = 2: a quarter of the feedforward active, as the paper's 16 x 128, k = 4
against d_ff 2053); its parameter count differs from the others by ~0.4%, reported by
``moeify count``.

``REPRO_PRESETS`` are table entries; moeify.models.presets lists them with the paper's and the
tiny ones.
"""

from __future__ import annotations

import dataclasses

from moeify.models.builders import Size, dense_lm, sigma_moe_ff
from moeify.models.config import ModelConfig
from moeify.models.match import match_attention
from moeify.models.registry import Preset

# vocab, d, L, T, xl, dropout, dense heads, dense d_head, dense d_ff
REPRO = Size(256, 128, 4, 128, True, 0.0, 8, 16, 512)


def repro_dense() -> ModelConfig:
    return dense_lm(REPRO, H=8)


def repro_dense_h2() -> ModelConfig:
    return dense_lm(REPRO, H=2)


def repro_switchhead() -> ModelConfig:
    return match_attention(repro_dense(), n_heads=2, n_experts=4, k=2).config


def repro_moa() -> ModelConfig:
    return match_attention(repro_dense(), kind="moa", n_heads=4, n_experts=8).config


def repro_switchall() -> ModelConfig:
    sh = repro_switchhead()
    ff = sigma_moe_ff(d=REPRO.d, L=REPRO.L, E=8, G=64, k=2, entropy_coef=1e-4,
                      expert_dropout=0.0)
    return dataclasses.replace(sh, feedforward=(ff,))


REPRO_PRESETS: tuple[Preset, ...] = (
    Preset("repro-dense", "CPU-scale family: dense XL H=8 d_h=16, d_ff=512 (the many-head "
           "baseline)", repro_dense),
    Preset("repro-dense-h2", "CPU-scale family: dense XL H=2 d_h=64, d_ff=512", repro_dense_h2,
           baseline="repro-dense"),
    Preset("repro-switchhead", "CPU-scale family: SwitchHead H=2 E=4 k=2, d_h and d_ff matched "
           "to repro-dense (spec §5)", repro_switchhead, baseline="repro-dense"),
    Preset("repro-moa", "CPU-scale family: MoA 4 selected heads of 8, d_h and d_ff matched to "
           "repro-dense", repro_moa, baseline="repro-dense"),
    Preset("repro-switchall", "CPU-scale family: repro-switchhead attention + sigma-MoE FFN "
           "8 x 64 k=2", repro_switchall, baseline="repro-dense"),
)
