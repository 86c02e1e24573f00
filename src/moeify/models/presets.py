"""The model presets: one literal table of named ModelConfig builders (``PRESETS``).

Paper presets are named ``{dataset}-{size}-{model}[-{variant}]`` after the SwitchHead paper's
rows (SwitchHead Table 9; Table 6 for the expert-subset ablations; Table 1 for MoA); each
entry carries its corpus, its dense baseline and its training recipe (``Preset``), so nothing
parses a name back apart. The dataset fixes the vocabulary (8000 BPE for WikiText-103, C4,
peS2o; the ~205 byte values of enwik8) and, for C4 / peS2o, the SwitchHead k of the row. The
size in the name is the size of the row the preset belongs to (a MAC-matched variant keeps its
base row's size in the name although it has more parameters: 63M / 376M / 54M). Table 1's MoA
d_ff (2060) comes from moeify.models.match against the 10-head dense 47M baseline with d_h = 88,
E = 10 (tests/models/test_match.py recomputes it). The follow-ups' rows live beside them
(moeify.models.moeut_presets, ``c4-{params}m-...``; moeify.models.mosa_presets,
``c4-mosa-{tiny|small|medium|large}-...`` after the MoSA paper's size names).

Small ``tiny-*`` presets (byte vocabulary 256, d_model 128, 4 layers, T = 128) exist for every
family and train a few hundred steps in minutes on a CPU; the ``repro-*`` family
(moeify.models.repro_presets) is parameter-matched at the same scale.

Derive variants with ``dataclasses.replace`` (e.g. the enwik8 vocabulary of a tokenised corpus).
"""

from __future__ import annotations

import difflib
from typing import Any, Callable

from moeify.models.builders import (  # noqa: F401  (re-exported: the preset building blocks)
    BIG_ROPE,
    BIG_XL,
    ENWIK8,
    SMALL_ROPE,
    SMALL_XL,
    Size,
    dense_attn,
    dense_ff,
    dense_lm,
    lm,
    moa_attn,
    moa_lm,
    mod,
    pos_of,
    sigma_moe_ff,
    switch_ff,
    switchall_259m,
    switchall_47m,
    switchhead_attn,
    switchhead_lm,
)
from moeify.models.config import ModelConfig
from moeify.models.match import MatchResult, match_attention
from moeify.models.registry import (
    BIG,
    ENWIK8_RECIPE,
    SMALL,
    SMALL_SWITCHALL,
    PaperRecipe,  # noqa: F401
    Preset,
    paper,
)
from moeify.models.moeut_presets import MOEUT_PRESETS
from moeify.models.mor_presets import MOR_PRESETS
from moeify.models.mosa_presets import MOSA_PRESETS
from moeify.models.moh_presets import MOH_PRESETS
from moeify.models.repro_presets import REPRO_PRESETS

# ---------------------------------------------------------------------------- tiny presets
# Byte-level, d = 128, 4 layers, T = 128: a few hundred steps in minutes on 2 CPU cores.
# No dropout: runs this short do not overfit.

TINY_XL = Size(vocab=256, d=128, L=4, T=128,
               xl=True, dropout=0.0, dense_heads=4, dense_d_head=32, dense_d_ff=512)
TINY_ROPE = Size(vocab=256, d=128, L=4, T=128,
                 xl=False, dropout=0.0, dense_heads=4, dense_d_head=32, dense_d_ff=512)


def _tiny_dense_attn(size: Size):
    return dense_attn(d=size.d, L=size.L, H=4, d_h=32, pos=pos_of(size))


def _tiny_sh_attn(size: Size):
    return switchhead_attn(d=size.d, L=size.L, H=2, d_h=32, E=4, k=2, pos=pos_of(size))


def _tiny_dense_ff(size: Size):
    return dense_ff(d=size.d, L=size.L, d_ff=512, dropout=0.0)


def _tiny_sigma(size: Size):
    return sigma_moe_ff(d=size.d, L=size.L, E=8, G=64, k=2, entropy_coef=1e-4,
                        expert_dropout=0.0)


def _tiny_switch(size: Size, noop: int = 0):
    return switch_ff(d=size.d, d_ff=256, E=4, k=1, noop=noop)


def tiny_dense() -> ModelConfig:
    return lm(TINY_XL, _tiny_dense_attn(TINY_XL), _tiny_dense_ff(TINY_XL))


def tiny_switchhead() -> ModelConfig:
    return lm(TINY_XL, _tiny_sh_attn(TINY_XL), _tiny_dense_ff(TINY_XL))


def tiny_moa() -> ModelConfig:
    return lm(TINY_XL, moa_attn(d=128, L=4, H=2, d_h=32, E=8, pos="xl"),
               _tiny_dense_ff(TINY_XL))


def tiny_sigmamoe() -> ModelConfig:
    return lm(TINY_XL, _tiny_dense_attn(TINY_XL), _tiny_sigma(TINY_XL))


def tiny_switchall() -> ModelConfig:
    return lm(TINY_XL, _tiny_sh_attn(TINY_XL), _tiny_sigma(TINY_XL))


def tiny_switch() -> ModelConfig:
    return lm(TINY_XL, _tiny_dense_attn(TINY_XL), _tiny_switch(TINY_XL))


def tiny_mod() -> ModelConfig:
    return lm(TINY_ROPE, _tiny_dense_attn(TINY_ROPE), _tiny_dense_ff(TINY_ROPE),
               depth=(None, mod(d=128, L=4)))


def tiny_mode() -> ModelConfig:
    return lm(TINY_ROPE, _tiny_dense_attn(TINY_ROPE), _tiny_switch(TINY_ROPE),
               depth=(None, mod(d=128, L=4)))


def tiny_mode_integrated() -> ModelConfig:
    return lm(TINY_ROPE, _tiny_dense_attn(TINY_ROPE), _tiny_switch(TINY_ROPE, noop=4))


# ---------------------------------------------------------------------------- the table

PAPER_PRESETS: tuple[Preset, ...] = (
    paper("wt103-47m-dense",
          "WT103 47M XL: dense baseline: H=10 d_h=41, d_ff=2053",
          lambda: dense_lm(SMALL_XL, H=10),
          data="wikitext-103", recipe=SMALL),
    paper("wt103-47m-dense-h2",
          "WT103 47M XL: dense baseline: H=2 d_h=205, d_ff=2053",
          lambda: dense_lm(SMALL_XL, H=2),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead",
          "WT103 47M XL: SwitchHead H=2 d_h=76 E=5 k=2, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=76, E=5, k=2, d_ff=2080),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchall",
          "WT103 47M XL: SwitchAll: SwitchHead H=2 d_h=76 E=5 k=2 + sigma-MoE FFN E=16 x 128 k=4",
          lambda: switchall_47m(k=2),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL_SWITCHALL),
    paper("wt103-47m-moa-h2",
          "WT103 47M XL: MoA H=2 selected heads of E=10, d_h=88, k=2, d_ff=2060",
          lambda: moa_lm(SMALL_XL, H=2, d_ff=2060),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-moa-h4",
          "WT103 47M XL: MoA H=4 selected heads of E=10, d_h=88, k=4, d_ff=2060",
          lambda: moa_lm(SMALL_XL, H=4, d_ff=2060),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-moa-h6",
          "WT103 47M XL: MoA H=6 selected heads of E=10, d_h=88, k=6, d_ff=2060",
          lambda: moa_lm(SMALL_XL, H=6, d_ff=2060),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-moa-h8",
          "WT103 47M XL: MoA H=8 selected heads of E=10, d_h=88, k=8, d_ff=2060",
          lambda: moa_lm(SMALL_XL, H=8, d_ff=2060),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-macmatched",
          "WT103 47M XL: MAC-matched (63M) SwitchHead H=3 d_h=112 E=5 k=2, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=3, d_h=112, E=5, k=2, d_ff=2080),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-sharedsel",
          "WT103 47M XL: SwitchHead H=2 d_h=76 E=5 k=2 shared selection, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=76, E=5, k=2, d_ff=2080, shared_selection=True),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("c4-47m-dense",
          "C4 47M XL: dense baseline: H=10 d_h=41, d_ff=2053",
          lambda: dense_lm(SMALL_XL, H=10),
          data="c4", recipe=SMALL),
    paper("c4-47m-dense-h2",
          "C4 47M XL: dense baseline: H=2 d_h=205, d_ff=2053",
          lambda: dense_lm(SMALL_XL, H=2),
          data="c4", baseline="c4-47m-dense", recipe=SMALL),
    paper("c4-47m-switchhead",
          "C4 47M XL: SwitchHead H=2 d_h=76 E=5 k=3, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=76, E=5, k=3, d_ff=2080),
          data="c4", baseline="c4-47m-dense", recipe=SMALL),
    paper("c4-47m-switchall",
          "C4 47M XL: SwitchAll: SwitchHead H=2 d_h=76 E=5 k=3 + sigma-MoE FFN E=16 x 128 k=4",
          lambda: switchall_47m(k=3),
          data="c4", baseline="c4-47m-dense", recipe=SMALL_SWITCHALL),
    paper("c4-47m-moa-h2",
          "C4 47M XL: MoA H=2 selected heads of E=10, d_h=88, k=2, d_ff=2060",
          lambda: moa_lm(SMALL_XL, H=2, d_ff=2060),
          data="c4", baseline="c4-47m-dense", recipe=SMALL),
    paper("c4-47m-moa-h4",
          "C4 47M XL: MoA H=4 selected heads of E=10, d_h=88, k=4, d_ff=2060",
          lambda: moa_lm(SMALL_XL, H=4, d_ff=2060),
          data="c4", baseline="c4-47m-dense", recipe=SMALL),
    paper("c4-47m-moa-h6",
          "C4 47M XL: MoA H=6 selected heads of E=10, d_h=88, k=6, d_ff=2060",
          lambda: moa_lm(SMALL_XL, H=6, d_ff=2060),
          data="c4", baseline="c4-47m-dense", recipe=SMALL),
    paper("c4-47m-moa-h8",
          "C4 47M XL: MoA H=8 selected heads of E=10, d_h=88, k=8, d_ff=2060",
          lambda: moa_lm(SMALL_XL, H=8, d_ff=2060),
          data="c4", baseline="c4-47m-dense", recipe=SMALL),
    paper("c4-47m-switchhead-macmatched",
          "C4 47M XL: MAC-matched (63M) SwitchHead H=3 d_h=112 E=5 k=3, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=3, d_h=112, E=5, k=3, d_ff=2080),
          data="c4", baseline="c4-47m-dense", recipe=SMALL),
    paper("c4-47m-switchhead-sharedsel",
          "C4 47M XL: SwitchHead H=2 d_h=76 E=5 k=3 shared selection, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=76, E=5, k=3, d_ff=2080, shared_selection=True),
          data="c4", baseline="c4-47m-dense", recipe=SMALL),
    paper("pes2o-47m-dense",
          "peS2o 47M XL: dense baseline: H=10 d_h=41, d_ff=2053",
          lambda: dense_lm(SMALL_XL, H=10),
          data="pes2o", recipe=SMALL),
    paper("pes2o-47m-dense-h2",
          "peS2o 47M XL: dense baseline: H=2 d_h=205, d_ff=2053",
          lambda: dense_lm(SMALL_XL, H=2),
          data="pes2o", baseline="pes2o-47m-dense", recipe=SMALL),
    paper("pes2o-47m-switchhead",
          "peS2o 47M XL: SwitchHead H=2 d_h=76 E=5 k=3, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=76, E=5, k=3, d_ff=2080),
          data="pes2o", baseline="pes2o-47m-dense", recipe=SMALL),
    paper("pes2o-47m-switchall",
          "peS2o 47M XL: SwitchAll: SwitchHead H=2 d_h=76 E=5 k=3 + sigma-MoE FFN E=16 x 128 k=4",
          lambda: switchall_47m(k=3),
          data="pes2o", baseline="pes2o-47m-dense", recipe=SMALL_SWITCHALL),
    paper("pes2o-47m-moa-h2",
          "peS2o 47M XL: MoA H=2 selected heads of E=10, d_h=88, k=2, d_ff=2060",
          lambda: moa_lm(SMALL_XL, H=2, d_ff=2060),
          data="pes2o", baseline="pes2o-47m-dense", recipe=SMALL),
    paper("pes2o-47m-moa-h4",
          "peS2o 47M XL: MoA H=4 selected heads of E=10, d_h=88, k=4, d_ff=2060",
          lambda: moa_lm(SMALL_XL, H=4, d_ff=2060),
          data="pes2o", baseline="pes2o-47m-dense", recipe=SMALL),
    paper("pes2o-47m-moa-h6",
          "peS2o 47M XL: MoA H=6 selected heads of E=10, d_h=88, k=6, d_ff=2060",
          lambda: moa_lm(SMALL_XL, H=6, d_ff=2060),
          data="pes2o", baseline="pes2o-47m-dense", recipe=SMALL),
    paper("pes2o-47m-moa-h8",
          "peS2o 47M XL: MoA H=8 selected heads of E=10, d_h=88, k=8, d_ff=2060",
          lambda: moa_lm(SMALL_XL, H=8, d_ff=2060),
          data="pes2o", baseline="pes2o-47m-dense", recipe=SMALL),
    paper("pes2o-47m-switchhead-macmatched",
          "peS2o 47M XL: MAC-matched (63M) SwitchHead H=3 d_h=112 E=5 k=3, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=3, d_h=112, E=5, k=3, d_ff=2080),
          data="pes2o", baseline="pes2o-47m-dense", recipe=SMALL),
    paper("pes2o-47m-switchhead-sharedsel",
          "peS2o 47M XL: SwitchHead H=2 d_h=76 E=5 k=3 shared selection, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=76, E=5, k=3, d_ff=2080, shared_selection=True),
          data="pes2o", baseline="pes2o-47m-dense", recipe=SMALL),
    paper("wt103-262m-dense",
          "WT103 262M XL: dense baseline: H=16 d_h=64, d_ff=4110",
          lambda: dense_lm(BIG_XL, H=16),
          data="wikitext-103", recipe=BIG),
    paper("wt103-262m-dense-h2",
          "WT103 262M XL: dense baseline: H=2 d_h=512, d_ff=4110",
          lambda: dense_lm(BIG_XL, H=2),
          data="wikitext-103", baseline="wt103-262m-dense", recipe=BIG),
    paper("wt103-262m-switchhead",
          "WT103 262M XL: SwitchHead H=2 d_h=132 E=8 k=4, d_ff=4147",
          lambda: switchhead_lm(BIG_XL, H=2, d_h=132, E=8, k=4, d_ff=4147),
          data="wikitext-103", baseline="wt103-262m-dense", recipe=BIG),
    paper("c4-262m-dense",
          "C4 262M XL: dense baseline: H=16 d_h=64, d_ff=4110",
          lambda: dense_lm(BIG_XL, H=16),
          data="c4", recipe=BIG),
    paper("c4-262m-dense-h4",
          "C4 262M XL: dense baseline: H=4 d_h=256, d_ff=4110",
          lambda: dense_lm(BIG_XL, H=4),
          data="c4", baseline="c4-262m-dense", recipe=BIG),
    paper("c4-262m-switchhead",
          "C4 262M XL: SwitchHead H=4 d_h=112 E=4 k=2, d_ff=4188",
          lambda: switchhead_lm(BIG_XL, H=4, d_h=112, E=4, k=2, d_ff=4188),
          data="c4", baseline="c4-262m-dense", recipe=BIG),
    paper("c4-262m-switchhead-macmatched",
          "C4 262M XL: MAC-matched (376M) SwitchHead H=6 d_h=168 E=4 k=2, d_ff=4188",
          lambda: switchhead_lm(BIG_XL, H=6, d_h=168, E=4, k=2, d_ff=4188),
          data="c4", baseline="c4-262m-dense", recipe=BIG),
    paper("pes2o-262m-dense",
          "peS2o 262M XL: dense baseline: H=16 d_h=64, d_ff=4110",
          lambda: dense_lm(BIG_XL, H=16),
          data="pes2o", recipe=BIG),
    paper("pes2o-262m-dense-h4",
          "peS2o 262M XL: dense baseline: H=4 d_h=256, d_ff=4110",
          lambda: dense_lm(BIG_XL, H=4),
          data="pes2o", baseline="pes2o-262m-dense", recipe=BIG),
    paper("pes2o-262m-switchhead",
          "peS2o 262M XL: SwitchHead H=4 d_h=112 E=4 k=2, d_ff=4188",
          lambda: switchhead_lm(BIG_XL, H=4, d_h=112, E=4, k=2, d_ff=4188),
          data="pes2o", baseline="pes2o-262m-dense", recipe=BIG),
    paper("pes2o-262m-switchhead-macmatched",
          "peS2o 262M XL: MAC-matched (376M) SwitchHead H=6 d_h=168 E=4 k=2, d_ff=4188",
          lambda: switchhead_lm(BIG_XL, H=6, d_h=168, E=4, k=2, d_ff=4188),
          data="pes2o", baseline="pes2o-262m-dense", recipe=BIG),
    paper("wt103-259m-switchall",
          "WT103 259M XL: SwitchAll: SwitchHead H=4 d_h=112 E=4 k=2 + sigma-MoE FFN E=32 x "
          "128 k=4",
          switchall_259m,
          data="wikitext-103", baseline="wt103-262m-dense", recipe=BIG),
    paper("c4-259m-switchall",
          "C4 259M XL: SwitchAll: SwitchHead H=4 d_h=112 E=4 k=2 + sigma-MoE FFN E=32 x 128 k=4",
          switchall_259m,
          data="c4", baseline="c4-262m-dense", recipe=BIG),
    paper("pes2o-259m-switchall",
          "peS2o 259M XL: SwitchAll: SwitchHead H=4 d_h=112 E=4 k=2 + sigma-MoE FFN E=32 x "
          "128 k=4",
          switchall_259m,
          data="pes2o", baseline="pes2o-262m-dense", recipe=BIG),
    paper("enwik8-41m-dense",
          "enwik8 41M XL: dense baseline: H=8 d_h=64, d_ff=2053",
          lambda: dense_lm(ENWIK8, H=8),
          data="enwik8", recipe=ENWIK8_RECIPE),
    paper("enwik8-41m-dense-h2",
          "enwik8 41M XL: dense baseline: H=2 d_h=256, d_ff=2053",
          lambda: dense_lm(ENWIK8, H=2),
          data="enwik8", baseline="enwik8-41m-dense", recipe=ENWIK8_RECIPE),
    paper("enwik8-41m-switchhead",
          "enwik8 41M XL: SwitchHead H=2 d_h=112 E=4 k=2, d_ff=2088",
          lambda: switchhead_lm(ENWIK8, H=2, d_h=112, E=4, k=2, d_ff=2088),
          data="enwik8", baseline="enwik8-41m-dense", recipe=ENWIK8_RECIPE),
    paper("wt103-45m-rope-dense",
          "WT103 45M RoPE: dense baseline: H=10 d_h=41, d_ff=2053",
          lambda: dense_lm(SMALL_ROPE, H=10),
          data="wikitext-103", recipe=SMALL),
    paper("wt103-45m-rope-dense-h2",
          "WT103 45M RoPE: dense baseline: H=2 d_h=205, d_ff=2053",
          lambda: dense_lm(SMALL_ROPE, H=2),
          data="wikitext-103", baseline="wt103-45m-rope-dense", recipe=SMALL),
    paper("wt103-45m-rope-switchhead",
          "WT103 45M RoPE: SwitchHead H=2 d_h=64 E=5 k=3, d_ff=2092",
          lambda: switchhead_lm(SMALL_ROPE, H=2, d_h=64, E=5, k=3, d_ff=2092),
          data="wikitext-103", baseline="wt103-45m-rope-dense", recipe=SMALL),
    paper("wt103-45m-rope-switchhead-macmatched",
          "WT103 45M RoPE: MAC-matched (54M) SwitchHead H=3 d_h=84 E=5 k=3, d_ff=2092",
          lambda: switchhead_lm(SMALL_ROPE, H=3, d_h=84, E=5, k=3, d_ff=2092),
          data="wikitext-103", baseline="wt103-45m-rope-dense", recipe=SMALL),
    paper("wt103-244m-rope-dense",
          "WT103 244M RoPE: dense baseline: H=16 d_h=64, d_ff=4110",
          lambda: dense_lm(BIG_ROPE, H=16),
          data="wikitext-103", recipe=BIG),
    paper("wt103-244m-rope-dense-h2",
          "WT103 244M RoPE: dense baseline: H=2 d_h=512, d_ff=4110",
          lambda: dense_lm(BIG_ROPE, H=2),
          data="wikitext-103", baseline="wt103-244m-rope-dense", recipe=BIG),
    paper("wt103-243m-rope-switchhead",
          "WT103 243M RoPE: SwitchHead H=4 d_h=100 E=4 k=2, d_ff=4136",
          lambda: switchhead_lm(BIG_ROPE, H=4, d_h=100, E=4, k=2, d_ff=4136),
          data="wikitext-103", baseline="wt103-244m-rope-dense", recipe=BIG),
    paper("wt103-47m-switchhead-experts-o",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=112 E=5 k=2 experts=O, d_ff=2065",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=112, E=5, k=2, d_ff=2065, experts=("o",)),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-v",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=112 E=5 k=2 experts=V, d_ff=2065",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=112, E=5, k=2, d_ff=2065, experts=("v",)),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-k",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=112 E=5 k=2 experts=K, d_ff=2065",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=112, E=5, k=2, d_ff=2065, experts=("k",)),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-q",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=112 E=5 k=2 experts=Q, d_ff=2065",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=112, E=5, k=2, d_ff=2065, experts=("q",)),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-ko",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=76 E=5 k=2 experts=KO, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=76, E=5, k=2, d_ff=2080, experts="ko"),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-vk",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=76 E=5 k=2 experts=VK, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=76, E=5, k=2, d_ff=2080, experts="vk"),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-vq",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=76 E=5 k=2 experts=VQ, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=76, E=5, k=2, d_ff=2080, experts="vq"),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-qo",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=76 E=5 k=2 experts=QO, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=76, E=5, k=2, d_ff=2080, experts="qo"),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-qk",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=76 E=5 k=2 experts=QK, d_ff=2080",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=76, E=5, k=2, d_ff=2080, experts="qk"),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-vok",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=56 E=5 k=2 experts=VOK, d_ff=2115",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=56, E=5, k=2, d_ff=2115, experts="vok"),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-voq",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=56 E=5 k=2 experts=VOQ, d_ff=2115",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=56, E=5, k=2, d_ff=2115, experts="voq"),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-qko",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=56 E=5 k=2 experts=QKO, d_ff=2115",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=56, E=5, k=2, d_ff=2115, experts="qko"),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-qkv",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=56 E=5 k=2 experts=QKV, d_ff=2115",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=56, E=5, k=2, d_ff=2115, experts="qkv"),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),
    paper("wt103-47m-switchhead-experts-vkqo",
          "WT103 47M XL (Table 6): SwitchHead H=2 d_h=48 E=5 k=2 experts=VKQO, d_ff=2060",
          lambda: switchhead_lm(SMALL_XL, H=2, d_h=48, E=5, k=2, d_ff=2060, experts="vkqo"),
          data="wikitext-103", baseline="wt103-47m-dense", recipe=SMALL),

)

TINY_PRESETS: tuple[Preset, ...] = (
    Preset("tiny-dense", "tiny XL: dense attention H=4 d_h=32, dense FFN d_ff=512",
           tiny_dense),
    Preset("tiny-switchhead", "tiny XL: SwitchHead H=2 d_h=32 E=4 k=2, dense FFN d_ff=512",
           tiny_switchhead, baseline="tiny-dense"),
    Preset("tiny-moa", "tiny XL: MoA H=2 selected heads of E=8, d_h=32, k=2, dense FFN d_ff=512",
           tiny_moa, baseline="tiny-dense"),
    Preset("tiny-sigmamoe", "tiny XL: dense attention H=4 d_h=32, sigma-MoE FFN E=8 x 64 k=2",
           tiny_sigmamoe, baseline="tiny-dense"),
    Preset("tiny-switchall",
           "tiny XL: SwitchAll: SwitchHead H=2 d_h=32 E=4 k=2 + "
           "sigma-MoE FFN E=8 x 64 k=2",
           tiny_switchall, baseline="tiny-dense"),
    Preset("tiny-switch", "tiny XL: dense attention H=4 d_h=32, Switch FFN E=4 x 256 k=1",
           tiny_switch, baseline="tiny-dense"),
    Preset("tiny-mod",
           "tiny RoPE: dense attention H=4 d_h=32, dense FFN d_ff=512, "
           "Mixture-of-Depths capacity 0.125 on every other block",
           tiny_mod),
    Preset("tiny-mode",
           "tiny RoPE: staged MoDE: Mixture-of-Depths capacity 0.125 on "
           "every other block, Switch FFN E=4 x 256 k=1, dense attention H=4 d_h=32",
           tiny_mode),
    Preset("tiny-mode-integrated",
           "tiny RoPE: integrated MoDE: Switch FFN E=4 x 256 k=1 plus 4 "
           "no-op experts, dense attention H=4 d_h=32",
           tiny_mode_integrated),
)

PRESETS: dict[str, Preset] = {p.name: p for p in PAPER_PRESETS + TINY_PRESETS + REPRO_PRESETS
                              + MOEUT_PRESETS + MOSA_PRESETS + MOR_PRESETS
                              + MOH_PRESETS}


def register(name: str, description: str, **facts: Any) -> Callable:
    """Decorator: add ``fn() -> ModelConfig`` to the table as preset ``name`` (``facts``: the
    Preset fields data / baseline / recipe)."""
    def deco(fn: Callable[[], ModelConfig]) -> Callable[[], ModelConfig]:
        if name in PRESETS:
            raise ValueError(f"preset {name!r} is registered twice")
        PRESETS[name] = Preset(name, description, fn, **facts)
        return fn
    return deco


def find_preset(name: str) -> Preset:
    """The table entry of preset ``name``; ValueError with close names when there is none."""
    try:
        return PRESETS[name]
    except KeyError:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown preset {name!r}{hint} (`moeify presets` lists them all)") \
            from None


def get_preset(name: str) -> ModelConfig:
    """The ModelConfig of preset ``name``."""
    return find_preset(name).fn()


def match_preset(name: str, **kwargs: Any) -> MatchResult:
    """``moeify.models.match.match_attention`` on the dense preset ``name``."""
    return match_attention(get_preset(name), **kwargs)
