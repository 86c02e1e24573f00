"""Named model presets: plain functions returning a ModelConfig, registered by name.

Paper presets are named ``{dataset}-{size}-{model}[-{variant}]`` after the SwitchHead paper's
rows (switchhead.md §4, Table 9; Table 6 for the expert-subset ablations; Table 1 for MoA).
The dataset part fixes the vocabulary (8000 BPE for WikiText-103, C4, peS2o; the ~205 byte
values of enwik8) and, for C4 / peS2o, the SwitchHead k of the row. The size part is the size
of the row the preset belongs to (a MAC-matched variant keeps its base row's size in the name
although it has more parameters: 63M / 376M / 54M).

Small ``tiny-*`` presets (byte vocabulary 256, d_model 128, 4 layers, T = 128) exist for every
family and train a few hundred steps in minutes on a CPU.

Derive variants with ``dataclasses.replace`` (e.g. the enwik8 vocabulary of a tokenised corpus).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

from moeify.models.config import ModelConfig


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    fn: Callable[[], ModelConfig]

    def build_config(self) -> ModelConfig:
        return self.fn()


PRESETS: dict[str, Preset] = {}


def register(name: str, description: str) -> Callable:
    """Decorator: register ``fn() -> ModelConfig`` as preset ``name``."""
    def deco(fn: Callable[[], ModelConfig]) -> Callable[[], ModelConfig]:
        if name in PRESETS:
            raise ValueError(f"preset {name!r} is registered twice")
        PRESETS[name] = Preset(name, description, fn)
        return fn
    return deco


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> ModelConfig:
    """The ModelConfig of preset ``name``."""
    try:
        return PRESETS[name].fn()
    except KeyError:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown preset {name!r}{hint} (`moeify presets` lists them all)") \
            from None


# ---------------------------------------------------------------------------- builders
# The only place that knows the layer configs' field names.

def dense_attn(*, d: int, L: int, H: int, d_h: int, pos: str):
    from moeify.layers.attention import DenseAttentionConfig

    return DenseAttentionConfig(d_model=d, n_heads=H, d_head=d_h, pos=pos, n_layers=L)


def switchhead_attn(*, d: int, L: int, H: int, d_h: int, E: int, k: int, pos: str,
                    experts: tuple[str, ...] = ("v", "o"), shared_selection: bool = False):
    from moeify.layers.switchhead import SwitchHeadConfig

    return SwitchHeadConfig(d_model=d, n_heads=H, d_head=d_h, n_experts=E, k=k, pos=pos,
                            experts=frozenset(experts), shared_selection=shared_selection,
                            n_layers=L)


def moa_attn(*, d: int, L: int, H: int, d_h: int, E: int, pos: str):
    """MoA with H selected heads (its top-k) out of E expert heads."""
    from moeify.layers.moa import MoAConfig

    return MoAConfig(d_model=d, n_experts=E, k=H, d_head=d_h, pos=pos, n_layers=L)


def dense_ff(*, d: int, L: int, d_ff: int, dropout: float):
    from moeify.layers.feedforward import DenseFFConfig

    return DenseFFConfig(d_model=d, d_ff=d_ff, dropout=dropout, n_layers=L)


def sigma_moe_ff(*, d: int, L: int, E: int, G: int, k: int, entropy_coef: float,
                 expert_dropout: float):
    from moeify.layers.feedforward import SigmaMoEConfig

    return SigmaMoEConfig(d_model=d, n_experts=E, expert_size=G, k=k,
                          entropy_coef=entropy_coef, expert_dropout=expert_dropout, n_layers=L)


def switch_ff(*, d: int, d_ff: int, E: int, k: int = 1, noop: int = 0,
              capacity_factor: float = 1.25):
    from moeify.layers.feedforward import SwitchFFConfig

    return SwitchFFConfig(d_model=d, d_ff=d_ff, n_experts=E, k=k, noop_experts=noop,
                          capacity_factor=capacity_factor)


def mod(*, d: int, L: int, capacity: float = 0.125):
    from moeify.layers.depth import MoDConfig

    return MoDConfig(d_model=d, capacity=capacity, n_layers=L)


# ---------------------------------------------------------------------------- paper geometry

@dataclass(frozen=True)
class Size:
    """The shape shared by a group of paper rows (switchhead.md §4)."""

    vocab: int
    d: int
    L: int
    T: int
    xl: bool
    dropout: float  # §3: 0.1 small / enwik8, 0.2 big
    dense_heads: int
    dense_d_head: int
    dense_d_ff: int


VOCAB_BPE = 8000
# enwik8 is bytes; the byte values that occur are about 205 (§3). A run tokenising the real
# corpus replaces vocab_size with the exact count.
VOCAB_ENWIK8 = 205

SMALL_XL = Size(VOCAB_BPE, 412, 16, 256, True, 0.1, 10, 41, 2053)
BIG_XL = Size(VOCAB_BPE, 1024, 18, 512, True, 0.2, 16, 64, 4110)
ENWIK8 = Size(VOCAB_ENWIK8, 512, 12, 512, True, 0.1, 8, 64, 2053)
SMALL_ROPE = Size(VOCAB_BPE, 412, 16, 512, False, 0.1, 10, 41, 2053)
BIG_ROPE = Size(VOCAB_BPE, 1024, 18, 1024, False, 0.2, 16, 64, 4110)


def _lm(size: Size, attention, feedforward, depth=None) -> ModelConfig:
    return ModelConfig(vocab_size=size.vocab, d_model=size.d, n_layers=size.L,
                       context_length=size.T, attention=attention, feedforward=feedforward,
                       depth=depth, xl_memory=size.xl, dropout=size.dropout)


def _pos(size: Size) -> str:
    return "xl" if size.xl else "rope"


def dense_lm(size: Size, *, H: int) -> ModelConfig:
    # Fewer-head baselines keep the total width H·d_h of the main one (10 x 41 -> 2 x 205).
    d_h = size.dense_heads * size.dense_d_head // H
    return _lm(size, dense_attn(d=size.d, L=size.L, H=H, d_h=d_h, pos=_pos(size)),
               dense_ff(d=size.d, L=size.L, d_ff=size.dense_d_ff, dropout=size.dropout))


def switchhead_lm(size: Size, *, H: int, d_h: int, E: int, k: int, d_ff: int,
                  experts: tuple[str, ...] = ("v", "o"),
                  shared_selection: bool = False) -> ModelConfig:
    return _lm(size, switchhead_attn(d=size.d, L=size.L, H=H, d_h=d_h, E=E, k=k, pos=_pos(size),
                                     experts=experts, shared_selection=shared_selection),
               dense_ff(d=size.d, L=size.L, d_ff=d_ff, dropout=size.dropout))


def switchall_lm(size: Size, *, H: int, d_h: int, E: int, k: int, ff_experts: int,
                 entropy_coef: float, expert_dropout: float) -> ModelConfig:
    # moe-family.md: sigma-MoE with G = 128, k = 4; no dropout inside the experts.
    return _lm(size, switchhead_attn(d=size.d, L=size.L, H=H, d_h=d_h, E=E, k=k, pos=_pos(size)),
               sigma_moe_ff(d=size.d, L=size.L, E=ff_experts, G=128, k=4,
                            entropy_coef=entropy_coef, expert_dropout=expert_dropout))


def moa_lm(size: Size, *, H: int, d_ff: int) -> ModelConfig:
    # Table 1's MoA rows: d_h = 88, E = 10 (back-solved from the printed MACs, §6).
    return _lm(size, moa_attn(d=size.d, L=size.L, H=H, d_h=88, E=10, pos=_pos(size)),
               dense_ff(d=size.d, L=size.L, d_ff=d_ff, dropout=size.dropout))


# MoA d_ff per selected-head count: from moeify.models.match.match_preset against the 10-head
# dense 47M baseline with d_h = 88, E = 10 fixed (tests/test_match.py recomputes them).
MOA_47M_D_FF = {2: 2060, 4: 2060, 6: 2060, 8: 2060}

# Table 6 (WT103 47M, H = 2, E = 5, k = 2, XL): expert projections -> (d_h, d_ff).
TABLE6 = {
    "o": (112, 2065), "v": (112, 2065), "k": (112, 2065), "q": (112, 2065),
    "ko": (76, 2080), "vk": (76, 2080), "vq": (76, 2080), "qo": (76, 2080), "qk": (76, 2080),
    "vok": (56, 2115), "voq": (56, 2115), "qko": (56, 2115), "qkv": (56, 2115),
    "vkqo": (48, 2060),
}


def _describe_sh(H, d_h, E, k, d_ff, extra=""):
    return f"SwitchHead H={H} d_h={d_h} E={E} k={k}{extra}, d_ff={d_ff}"


def _register_paper_presets() -> None:
    def reg(name: str, description: str, fn: Callable[[], ModelConfig]) -> None:
        fn.__name__ = name.replace("-", "_")
        register(name, description)(fn)

    def dense_rows(prefix: str, size: Size, what: str, extra_heads: int) -> None:
        width = size.dense_heads * size.dense_d_head
        for H, suffix in ((size.dense_heads, ""), (extra_heads, f"-h{extra_heads}")):
            reg(f"{prefix}-dense{suffix}", f"{what} dense baseline: H={H} d_h={width // H}, "
                f"d_ff={size.dense_d_ff}", lambda H=H: dense_lm(size, H=H))

    def sh_row(name: str, size: Size, what: str, *, H, d_h, E, k, d_ff, experts=("v", "o"),
               shared=False) -> None:
        extra = (f" experts={''.join(experts).upper()}" if tuple(experts) != ("v", "o") else "") \
            + (" shared selection" if shared else "")
        reg(name, f"{what} {_describe_sh(H, d_h, E, k, d_ff, extra)}",
            lambda: switchhead_lm(size, H=H, d_h=d_h, E=E, k=k, d_ff=d_ff, experts=experts,
                                  shared_selection=shared))

    # ---- 47M Transformer-XL class: WikiText-103 (k = 2), C4 and peS2o (k = 3).
    for ds, name, k in (("wt103", "WT103", 2), ("c4", "C4", 3), ("pes2o", "peS2o", 3)):
        what = f"{name} 47M XL:"
        dense_rows(f"{ds}-47m", SMALL_XL, what, 2)
        sh_row(f"{ds}-47m-switchhead", SMALL_XL, what, H=2, d_h=76, E=5, k=k, d_ff=2080)
        reg(f"{ds}-47m-switchall", f"{what} SwitchAll: SwitchHead H=2 d_h=76 E=5 k={k} + "
            "sigma-MoE FFN E=16 x 128 k=4",
            lambda k=k: switchall_lm(SMALL_XL, H=2, d_h=76, E=5, k=k, ff_experts=16,
                                     entropy_coef=1e-4, expert_dropout=0.0))
        for H, d_ff in MOA_47M_D_FF.items():
            reg(f"{ds}-47m-moa-h{H}", f"{what} MoA H={H} selected heads of E=10, d_h=88, "
                f"k={H}, d_ff={d_ff}", lambda H=H, d_ff=d_ff: moa_lm(SMALL_XL, H=H, d_ff=d_ff))
        # §3.5: MAC-matched to the dense baseline (63M parameters).
        sh_row(f"{ds}-47m-switchhead-macmatched", SMALL_XL, f"{what} MAC-matched (63M)",
               H=3, d_h=112, E=5, k=k, d_ff=2080)
        sh_row(f"{ds}-47m-switchhead-sharedsel", SMALL_XL, what, H=2, d_h=76, E=5, k=k,
               d_ff=2080, shared=True)

    # ---- 262M Transformer-XL class.
    dense_rows("wt103-262m", BIG_XL, "WT103 262M XL:", 2)
    sh_row("wt103-262m-switchhead", BIG_XL, "WT103 262M XL:", H=2, d_h=132, E=8, k=4,
           d_ff=4147)
    for ds, name in (("c4", "C4"), ("pes2o", "peS2o")):
        what = f"{name} 262M XL:"
        dense_rows(f"{ds}-262m", BIG_XL, what, 4)
        sh_row(f"{ds}-262m-switchhead", BIG_XL, what, H=4, d_h=112, E=4, k=2, d_ff=4188)
        sh_row(f"{ds}-262m-switchhead-macmatched", BIG_XL, f"{what} MAC-matched (376M)",
               H=6, d_h=168, E=4, k=2, d_ff=4188)
    for ds, name in (("wt103", "WT103"), ("c4", "C4"), ("pes2o", "peS2o")):
        reg(f"{ds}-259m-switchall", f"{name} 259M XL: SwitchAll: SwitchHead H=4 d_h=112 E=4 k=2"
            " + sigma-MoE FFN E=32 x 128 k=4",
            lambda: switchall_lm(BIG_XL, H=4, d_h=112, E=4, k=2, ff_experts=32,
                                 entropy_coef=1e-3, expert_dropout=0.1))

    # ---- enwik8 (bytes).
    dense_rows("enwik8-41m", ENWIK8, "enwik8 41M XL:", 2)
    sh_row("enwik8-41m-switchhead", ENWIK8, "enwik8 41M XL:", H=2, d_h=112, E=4, k=2,
           d_ff=2088)

    # ---- RoPE, no XL memory.
    dense_rows("wt103-45m-rope", SMALL_ROPE, "WT103 45M RoPE:", 2)
    sh_row("wt103-45m-rope-switchhead", SMALL_ROPE, "WT103 45M RoPE:", H=2, d_h=64, E=5, k=3,
           d_ff=2092)
    sh_row("wt103-45m-rope-switchhead-macmatched", SMALL_ROPE, "WT103 45M RoPE: MAC-matched "
           "(54M)", H=3, d_h=84, E=5, k=3, d_ff=2092)
    dense_rows("wt103-244m-rope", BIG_ROPE, "WT103 244M RoPE:", 2)
    sh_row("wt103-243m-rope-switchhead", BIG_ROPE, "WT103 243M RoPE:", H=4, d_h=100, E=4, k=2,
           d_ff=4136)

    # ---- Table 6: which projections are experts.
    for tag, (d_h, d_ff) in TABLE6.items():
        sh_row(f"wt103-47m-switchhead-experts-{tag}", SMALL_XL, "WT103 47M XL (Table 6):",
               H=2, d_h=d_h, E=5, k=2, d_ff=d_ff, experts=tuple(tag))


_register_paper_presets()


# ---------------------------------------------------------------------------- tiny presets
# Byte-level, d = 128, 4 layers, T = 128: a few hundred steps in minutes on 2 CPU cores.
# No dropout: runs this short do not overfit.

TINY_XL = Size(256, 128, 4, 128, True, 0.0, 4, 32, 512)
TINY_ROPE = Size(256, 128, 4, 128, False, 0.0, 4, 32, 512)


def _tiny_dense_attn(size: Size):
    return dense_attn(d=size.d, L=size.L, H=4, d_h=32, pos=_pos(size))


def _tiny_sh_attn(size: Size):
    return switchhead_attn(d=size.d, L=size.L, H=2, d_h=32, E=4, k=2, pos=_pos(size))


def _tiny_dense_ff(size: Size):
    return dense_ff(d=size.d, L=size.L, d_ff=512, dropout=0.0)


def _tiny_sigma(size: Size):
    return sigma_moe_ff(d=size.d, L=size.L, E=8, G=64, k=2, entropy_coef=1e-4,
                        expert_dropout=0.0)


def _tiny_switch(size: Size, noop: int = 0):
    return switch_ff(d=size.d, d_ff=256, E=4, k=1, noop=noop)


@register("tiny-dense", "tiny XL: dense attention H=4 d_h=32, dense FFN d_ff=512")
def tiny_dense() -> ModelConfig:
    return _lm(TINY_XL, _tiny_dense_attn(TINY_XL), _tiny_dense_ff(TINY_XL))


@register("tiny-switchhead", "tiny XL: SwitchHead H=2 d_h=32 E=4 k=2, dense FFN d_ff=512")
def tiny_switchhead() -> ModelConfig:
    return _lm(TINY_XL, _tiny_sh_attn(TINY_XL), _tiny_dense_ff(TINY_XL))


@register("tiny-moa", "tiny XL: MoA H=2 selected heads of E=8, d_h=32, k=2, dense FFN "
          "d_ff=512")
def tiny_moa() -> ModelConfig:
    return _lm(TINY_XL, moa_attn(d=128, L=4, H=2, d_h=32, E=8, pos="xl"),
               _tiny_dense_ff(TINY_XL))


@register("tiny-sigmamoe", "tiny XL: dense attention H=4 d_h=32, sigma-MoE FFN E=8 x 64 k=2")
def tiny_sigmamoe() -> ModelConfig:
    return _lm(TINY_XL, _tiny_dense_attn(TINY_XL), _tiny_sigma(TINY_XL))


@register("tiny-switchall", "tiny XL: SwitchAll: SwitchHead H=2 d_h=32 E=4 k=2 + sigma-MoE FFN "
          "E=8 x 64 k=2")
def tiny_switchall() -> ModelConfig:
    return _lm(TINY_XL, _tiny_sh_attn(TINY_XL), _tiny_sigma(TINY_XL))


@register("tiny-switch", "tiny XL: dense attention H=4 d_h=32, Switch FFN E=4 x 256 k=1")
def tiny_switch() -> ModelConfig:
    return _lm(TINY_XL, _tiny_dense_attn(TINY_XL), _tiny_switch(TINY_XL))


@register("tiny-mod", "tiny RoPE: dense attention H=4 d_h=32, dense FFN d_ff=512, "
          "Mixture-of-Depths capacity 0.125 on every other block")
def tiny_mod() -> ModelConfig:
    return _lm(TINY_ROPE, _tiny_dense_attn(TINY_ROPE), _tiny_dense_ff(TINY_ROPE),
               depth=(None, mod(d=128, L=4)))


@register("tiny-mode", "tiny RoPE: staged MoDE: Mixture-of-Depths capacity 0.125 on every "
          "other block, Switch FFN E=4 x 256 k=1, dense attention H=4 d_h=32")
def tiny_mode() -> ModelConfig:
    return _lm(TINY_ROPE, _tiny_dense_attn(TINY_ROPE), _tiny_switch(TINY_ROPE),
               depth=(None, mod(d=128, L=4)))


@register("tiny-mode-integrated", "tiny RoPE: integrated MoDE: Switch FFN E=4 x 256 k=1 plus "
          "4 no-op experts, dense attention H=4 d_h=32")
def tiny_mode_integrated() -> ModelConfig:
    return _lm(TINY_ROPE, _tiny_dense_attn(TINY_ROPE), _tiny_switch(TINY_ROPE, noop=4))


# The CPU-scale reproduction family (repro-*) registers itself on import; it builds on the
# helpers above, hence the import at the end.
from moeify.models import repro_presets as _repro_presets  # noqa: E402,F401
