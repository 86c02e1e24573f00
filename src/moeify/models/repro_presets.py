"""A CPU-scale, parameter-matched family mirroring the SwitchHead paper's WT103 47M comparison
(Tables 1-3): dense with many heads, dense with 2 heads, SwitchHead, MoA and SwitchAll.

Shape: byte vocabulary (256; the trainer sets the tokenizer's), d = 128, L = 4, T = 128 with
one chunk of XL memory, no dropout (runs are far too short to overfit). The dense baseline has
8 heads of d_h = 16 (H·d_h = d, as the paper's 10 x 41 for d = 412); the 2-head baseline keeps
the total width (2 x 64), as the paper's 2 x 205.

SwitchHead follows its §3: H·E equals the baseline's head count (H = 2, E = 4, k = 2), and
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
REPRO = Size(vocab=256, d=128, L=4, T=128,
             xl=True, dropout=0.0, dense_heads=8, dense_d_head=16, dense_d_ff=512)
# repro-switchhead-macmatched's d_head: the largest multiple of 4 whose attention MACs
# (moeify.models.cost)
# do not exceed repro-dense's with H = 3 (tests check it).
MACMATCHED_D_HEAD = 40


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


def repro_switchhead_macmatched() -> ModelConfig:
    # §3.5 / Table 4's MAC-matched variant: one more head and wider heads, at the dense model's
    # attention MACs (more parameters); the feedforward stays that of repro-switchhead.
    sh = repro_switchhead()
    attn = dataclasses.replace(sh.attention[0], n_heads=3, d_head=MACMATCHED_D_HEAD)
    return dataclasses.replace(sh, attention=(attn,))


def repro_switchhead_sharedsel() -> ModelConfig:
    # SwitchHead appendix "shared selection": one W_S serves V and O, matched to the dense model
    # again.
    return match_attention(repro_dense(), n_heads=2, n_experts=4, k=2,
                           shared_selection=True).config


# A family 4x larger in parameters (d_model 256), matched the same way: the dense baseline has
# 8 heads of d_h = 32 (H·d_h = d), the 2-head one 2 x 128, SwitchHead H = 2, E = 4, k = 2.
REPRO256 = Size(vocab=256, d=256, L=4, T=128,
                xl=True, dropout=0.0, dense_heads=8, dense_d_head=32, dense_d_ff=1024)


def repro256_dense() -> ModelConfig:
    return dense_lm(REPRO256, H=8)


def repro256_dense_h2() -> ModelConfig:
    return dense_lm(REPRO256, H=2)


def repro256_switchhead() -> ModelConfig:
    return match_attention(repro256_dense(), n_heads=2, n_experts=4, k=2).config


def repro256_moa() -> ModelConfig:
    return match_attention(repro256_dense(), kind="moa", n_heads=4, n_experts=8).config


REPRO_PRESETS: tuple[Preset, ...] = (
    Preset("repro-dense", "CPU-scale family: dense XL H=8 d_h=16, d_ff=512 (the many-head "
           "baseline)", repro_dense),
    Preset("repro-dense-h2", "CPU-scale family: dense XL H=2 d_h=64, d_ff=512", repro_dense_h2,
           baseline="repro-dense"),
    Preset("repro-switchhead", "CPU-scale family: SwitchHead H=2 E=4 k=2, d_h and d_ff matched "
           "to repro-dense (SwitchHead §3)", repro_switchhead, baseline="repro-dense"),
    Preset("repro-moa", "CPU-scale family: MoA 4 selected heads of 8, d_h and d_ff matched to "
           "repro-dense", repro_moa, baseline="repro-dense"),
    Preset("repro-switchall", "CPU-scale family: repro-switchhead attention + sigma-MoE FFN "
           "8 x 64 k=2", repro_switchall, baseline="repro-dense"),
    Preset("repro-switchhead-macmatched", "CPU-scale family: repro-switchhead with H=3 and d_h "
           "chosen for repro-dense's attention MACs (§3.5, more parameters)",
           repro_switchhead_macmatched, baseline="repro-dense"),
    Preset("repro-switchhead-sharedsel", "CPU-scale family: SwitchHead H=2 E=4 k=2 with one "
           "selection for V and O, matched to repro-dense", repro_switchhead_sharedsel,
           baseline="repro-dense"),
    Preset("repro256-dense", "CPU-scale family x4 (d_model 256): dense XL H=8 d_h=32, "
           "d_ff=1024", repro256_dense),
    Preset("repro256-dense-h2", "CPU-scale family x4: dense XL H=2 d_h=128, d_ff=1024",
           repro256_dense_h2, baseline="repro256-dense"),
    Preset("repro256-switchhead", "CPU-scale family x4: SwitchHead H=2 E=4 k=2, matched to "
           "repro256-dense", repro256_switchhead, baseline="repro256-dense"),
    Preset("repro256-moa", "CPU-scale family x4: MoA 4 selected heads of 8, matched to "
           "repro256-dense", repro256_moa, baseline="repro256-dense"),
)
