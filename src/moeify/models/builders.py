"""The pieces presets are built from: layer-config builders (the only place that knows the layer
configs' field names), the paper's model shapes (``Size``, SwitchHead Table 9) and one LM builder
per paper family. moeify.models.presets lists the presets themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.depth import MoDConfig
from moeify.layers.feedforward import DenseFFConfig, SigmaMoEConfig, SwitchFFConfig
from moeify.layers.moa import MoAConfig
from moeify.layers.switchhead import SwitchHeadConfig
from moeify.models.config import ModelConfig


def dense_attn(*, d: int, L: int, H: int, d_h: int, pos: str):
    return DenseAttentionConfig(d_model=d, n_heads=H, d_head=d_h, pos=pos, n_layers=L)


def switchhead_attn(*, d: int, L: int, H: int, d_h: int, E: int, k: int, pos: str,
                    experts: tuple[str, ...] = ("v", "o"), shared_selection: bool = False):
    return SwitchHeadConfig(d_model=d, n_heads=H, d_head=d_h, n_experts=E, k=k, pos=pos,
                            experts=frozenset(experts), shared_selection=shared_selection,
                            n_layers=L)


def moa_attn(*, d: int, L: int, H: int, d_h: int, E: int, pos: str):
    """MoA with H selected heads (its top-k) out of E expert heads."""
    return MoAConfig(d_model=d, n_experts=E, k=H, d_head=d_h, pos=pos, n_layers=L)


def dense_ff(*, d: int, L: int, d_ff: int, dropout: float):
    return DenseFFConfig(d_model=d, d_ff=d_ff, dropout=dropout, n_layers=L)


def sigma_moe_ff(*, d: int, L: int, E: int, G: int, k: int, entropy_coef: float,
                 expert_dropout: float):
    return SigmaMoEConfig(d_model=d, n_experts=E, expert_size=G, k=k,
                          entropy_coef=entropy_coef, expert_dropout=expert_dropout, n_layers=L)


def switch_ff(*, d: int, d_ff: int, E: int, k: int = 1, noop: int = 0,
              capacity_factor: float = 1.25):
    return SwitchFFConfig(d_model=d, d_ff=d_ff, n_experts=E, k=k, noop_experts=noop,
                          capacity_factor=capacity_factor)


def mod(*, d: int, L: int, capacity: float = 0.125):
    return MoDConfig(d_model=d, capacity=capacity, n_layers=L)


# ---------------------------------------------------------------------------- paper geometry

@dataclass(frozen=True, kw_only=True)
class Size:
    """The shape shared by a group of paper rows (SwitchHead Table 9); keyword-only, so that a
    row reads as what each number is."""

    vocab: int         # vocabulary size
    d: int             # d_model
    L: int             # layers
    T: int             # context length
    xl: bool           # Transformer-XL memory and relative positions (else RoPE)
    dropout: float     # §3: 0.1 small / enwik8, 0.2 big
    dense_heads: int   # the dense baseline's attention heads
    dense_d_head: int  # ... their head width
    dense_d_ff: int    # the dense feedforward width


VOCAB_BPE = 8000
# enwik8 is bytes; the byte values that occur are about 205 (§3). A run tokenising the real
# corpus replaces vocab_size with the exact count.
VOCAB_ENWIK8 = 205

SMALL_XL = Size(vocab=VOCAB_BPE, d=412, L=16, T=256,
                xl=True, dropout=0.1, dense_heads=10, dense_d_head=41, dense_d_ff=2053)
BIG_XL = Size(vocab=VOCAB_BPE, d=1024, L=18, T=512,
              xl=True, dropout=0.2, dense_heads=16, dense_d_head=64, dense_d_ff=4110)
ENWIK8 = Size(vocab=VOCAB_ENWIK8, d=512, L=12, T=512,
              xl=True, dropout=0.1, dense_heads=8, dense_d_head=64, dense_d_ff=2053)
SMALL_ROPE = Size(vocab=VOCAB_BPE, d=412, L=16, T=512,
                  xl=False, dropout=0.1, dense_heads=10, dense_d_head=41, dense_d_ff=2053)
BIG_ROPE = Size(vocab=VOCAB_BPE, d=1024, L=18, T=1024,
                xl=False, dropout=0.2, dense_heads=16, dense_d_head=64, dense_d_ff=4110)


def lm(size: Size, attention, feedforward, depth=None) -> ModelConfig:
    return ModelConfig(vocab_size=size.vocab, d_model=size.d, n_layers=size.L,
                       context_length=size.T, attention=attention, feedforward=feedforward,
                       depth=depth, xl_memory=size.xl, dropout=size.dropout)


def pos_of(size: Size) -> str:
    return "xl" if size.xl else "rope"


def dense_lm(size: Size, *, H: int) -> ModelConfig:
    # Fewer-head baselines keep the total width H·d_h of the main one (10 x 41 -> 2 x 205).
    d_h = size.dense_heads * size.dense_d_head // H
    return lm(size, dense_attn(d=size.d, L=size.L, H=H, d_h=d_h, pos=pos_of(size)),
               dense_ff(d=size.d, L=size.L, d_ff=size.dense_d_ff, dropout=size.dropout))


def switchhead_lm(size: Size, *, H: int, d_h: int, E: int, k: int, d_ff: int,
                  experts: tuple[str, ...] = ("v", "o"),
                  shared_selection: bool = False) -> ModelConfig:
    return lm(size, switchhead_attn(d=size.d, L=size.L, H=H, d_h=d_h, E=E, k=k, pos=pos_of(size),
                                     experts=experts, shared_selection=shared_selection),
               dense_ff(d=size.d, L=size.L, d_ff=d_ff, dropout=size.dropout))


def switchall_lm(size: Size, *, H: int, d_h: int, E: int, k: int, ff_experts: int,
                 entropy_coef: float, expert_dropout: float) -> ModelConfig:
    # SwitchAll's sigma-MoE (SwitchHead Table 9): G = 128, k = 4; no dropout inside the experts.
    return lm(size, switchhead_attn(d=size.d, L=size.L, H=H, d_h=d_h, E=E, k=k, pos=pos_of(size)),
               sigma_moe_ff(d=size.d, L=size.L, E=ff_experts, G=128, k=4,
                            entropy_coef=entropy_coef, expert_dropout=expert_dropout))


def moa_lm(size: Size, *, H: int, d_ff: int) -> ModelConfig:
    # Table 1's MoA rows: d_h = 88, E = 10 (back-solved from the printed MACs, §6).
    return lm(size, moa_attn(d=size.d, L=size.L, H=H, d_h=88, E=10, pos=pos_of(size)),
               dense_ff(d=size.d, L=size.L, d_ff=d_ff, dropout=size.dropout))


def switchall_47m(k: int) -> ModelConfig:
    """The 47M SwitchAll rows: SwitchHead H=2 d_h=76 E=5 + sigma-MoE E=16 x 128 (Table 3)."""
    return switchall_lm(SMALL_XL, H=2, d_h=76, E=5, k=k, ff_experts=16, entropy_coef=1e-4,
                        expert_dropout=0.0)


def switchall_259m() -> ModelConfig:
    """The 259M SwitchAll rows: SwitchHead H=4 d_h=112 E=4 k=2 + sigma-MoE E=32 x 128 (Table 3)."""
    return switchall_lm(BIG_XL, H=4, d_h=112, E=4, k=2, ff_experts=32, entropy_coef=1e-3,
                        expert_dropout=0.1)
