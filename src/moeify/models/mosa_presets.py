"""MoSA presets (Piękos, Csordás, Schmidhuber 2025, arXiv 2505.00315): the paper compares MoSA
with dense attention at equal compute, spending what the sparse heads save on more heads,
and keeps a few dense heads beside the sparse ones (the hybrid).

The paper rows (C4; Sec. 3 "Implementation details" and App. C) are named
``c4-mosa-{size}-{variant}`` after the paper's four sizes, Tiny, Small, Medium and Large:

- ``c4-mosa-{size}-dense``: the dense baselines of Table 4 (layers, hidden size h, feedforward
  4h, 9 or 16 heads of h' = 64); ``moeify count`` gives the 28M / 113M / 210M / 516M of Sec. 3
  and Tables 1 and 5.
- ``c4-mosa-{size}-r{rho}``: Table 5's hybrid "MoSA" rows, 4 dense heads plus H_mosa MoSA heads
  of sparsity rho (k = 1024 / rho tokens per head), one preset per sparsity the table lists
  (Tiny 2-256, Small 2-64, Medium 2-32, Large 2-4).
- ``c4-mosa-{size}-pure-r{rho}``: Table 5's "Pure MoSA" rows (MoSA heads only), rho 2-16
  (Large 2-4).
- ``c4-mosa-{size}-matched``: Table 2's perplexity-matched rows (Sec. 3.3): 4 dense heads and
  17 / 14 / 12 / 16 MoSA heads at rho = 32 (Large: 16).
- ``c4-mosa-long-t{T}``: Sec. 3.4's long-sequence models (local heads instead of dense ones),
  T = 1024, 2048, 4096, 8192.

Each MoSA row's baseline is its size's dense preset. H_mosa of an IsoFLOP row is not typed in:
moeify.models.cost.mosa_isoflop_heads derives it with the paper's rule (the largest number of
heads whose forward FLOPs, App. A, do not exceed the dense baseline's), which reproduces every
head count of Table 5 (tests/models/test_mosa_paper_rows.py, against the table's numbers).
``moeify count`` gives every row's parameter count as Table 5 prints it (whole millions below
1B; "1.2B", "1.1B", "1B" in billions at the printed precision); read as 1.0B, the "1B" of
Large pure rho = 4 would be off: the rule's 80 heads count 1,085.2M (1.1B).

The setting, from the paper: SentencePiece vocabulary 8000, T = 1024, batch 64, Adam at 2.5e-4,
clipping 0.25, 4k warm-up steps, 100k steps (Sec. 3; ``MOSA_C4`` holds the batch, warm-up and
clipping, as every paper recipe here; moeify.train.config.paper_recipe adds Adam at 2.5e-4 and
100k steps, and also cosine decay and fp16, which the paper does not state); pre-layernorm
blocks (App. C); RoPE on half of each head's channels in every model, the dense baselines
included (Sec. 2.2, "Positional encodings"); the IsoFLOP rows always include the first token in
every MoSA head (Sec. 3.2: k - 1 routed tokens and the first), ``include_first=True``. Not
stated by the paper, moeify's defaults: no dropout, an untied output layer with a bias,
LayerNorms with biases, ReLU MLPs with biases, bias-free attention and routers (as the authors'
layer, piotrpiekos/MoSA mosa/). The counts confirm the untied output layer (tied, Tiny would
count 23.8M, not 28M); the biases are below the printed precision. The Table 2 rows also include
the first token: Sec. 3.3 does not say, and moeify assumes the IsoFLOP rows' setting, of which
they are a head count. Two of the paper's printed figures disagree with its own formulas
(tests/models/test_mosa_paper_rows.py): Table 4's Medium FLOPs (430.70G; the formula, and Table
5's Medium head counts, need 439.70G = twice Small's) and Table 2's MoSA KV totals (4.5K / 4.4K
/ 4.4K / 5.0K, where KV = T·H_dense + k·H_mosa gives 4.6K / 4.5K / 4.5K / 5.1K; 1000·H_dense +
k·H_mosa gives the printed ones).

``tiny-mosa`` and ``repro-mosa`` replace the 4-head (tiny) / 8-head (repro) dense RoPE attention
by 32 MoSA heads of d_h = 32 with sparsity rho = 8 (k = 16 of T = 128 tokens) plus one dense head
of d_h = 32: their attention MACs per layer equal the dense model's exactly under
moeify.models.cost (12,582,912 MACs; tests/models/test_mosa_presets.py), the paper's
compute-matched comparison in moeify's MAC accounting. They have more parameters than the
dense model, as the paper's compute-matched MoSA models do.
"""

from __future__ import annotations

import dataclasses

from moeify.layers.mosa import MoSAConfig
from moeify.models.builders import Size, dense_ff, dense_lm, lm
from moeify.models.config import ModelConfig
from moeify.models.cost import mosa_isoflop_heads
from moeify.models.registry import PaperRecipe, Preset, paper

TINY_ROPE = Size(vocab=256, d=128, L=4, T=128,
                 xl=False, dropout=0.0, dense_heads=4, dense_d_head=32, dense_d_ff=512)
REPRO_ROPE = Size(vocab=256, d=128, L=4, T=128,
                  xl=False, dropout=0.0, dense_heads=8, dense_d_head=16, dense_d_ff=512)


def mosa_attn(*, d: int, L: int, H: int, d_h: int, sparsity: int, dense_heads: int = 0,
              pos: str = "rope", include_first: bool = False) -> MoSAConfig:
    return MoSAConfig(d_model=d, n_heads=H, d_head=d_h, sparsity=sparsity,
                      n_dense_heads=dense_heads, pos=pos, n_layers=L,
                      include_first=include_first)


def mosa_lm(size: Size, *, H: int, d_h: int, sparsity: int, dense_heads: int,
            d_ff: int, include_first: bool = False) -> ModelConfig:
    if size.xl:
        raise ValueError("MoSA is a RoPE model: build it on a Size without XL memory")
    return lm(size, mosa_attn(d=size.d, L=size.L, H=H, d_h=d_h, sparsity=sparsity,
                              dense_heads=dense_heads, include_first=include_first),
              dense_ff(d=size.d, L=size.L, d_ff=d_ff, dropout=size.dropout))


def tiny_mosa() -> ModelConfig:
    return mosa_lm(TINY_ROPE, H=32, d_h=32, sparsity=8, dense_heads=1, d_ff=512)


def repro_mosa() -> ModelConfig:
    return mosa_lm(REPRO_ROPE, H=32, d_h=32, sparsity=8, dense_heads=1, d_ff=512)


# The paper's own recipe at the CPU scale: its hybrid keeps 4 of the baseline's dense heads
# (Sec. 3.2, App. B: 4 was best of 0..9) and fills the rest of the dense model's FLOPs with MoSA
# heads of the same width by its IsoFLOP rule (App. A), the first token always selected. rho = 8
# keeps k = 16 tokens of T = 128, the k of Tiny's best row (rho = 64 of T = 1024).
REPRO_PAPER_SPARSITY = 8


def repro_mosa_paper_heads() -> int:
    s = REPRO_ROPE
    return mosa_isoflop_heads(n_layers=s.L, d_model=s.d, d_head=s.dense_d_head, T=s.T,
                              baseline_heads=s.dense_heads, sparsity=REPRO_PAPER_SPARSITY,
                              n_dense_heads=4)


def repro_mosa_paper() -> ModelConfig:
    return mosa_lm(REPRO_ROPE, H=repro_mosa_paper_heads(), d_h=REPRO_ROPE.dense_d_head,
                   sparsity=REPRO_PAPER_SPARSITY, dense_heads=4, d_ff=REPRO_ROPE.dense_d_ff,
                   include_first=True)


# ---------------------------------------------------------------------------- the paper's rows

VOCAB_C4 = 8000
# Sec. 3, "Implementation details": batch 64, linear warm-up 4k steps, clipping 0.25.
MOSA_C4 = PaperRecipe(batch_size=64, warmup_steps=4000, grad_clip=0.25)

# Table 4: size -> the dense baseline (layers, hidden size h, head width h', heads); the
# feedforward is 4h (Table 4's row; App. A's 16h^2T), T = 1024.
MOSA_SIZES: dict[str, Size] = {
    name: Size(vocab=VOCAB_C4, d=h, L=L, T=1024, xl=False, dropout=0.0, dense_heads=H,
               dense_d_head=64, dense_d_ff=4 * h)
    for name, (L, h, H) in {"tiny": (6, 512, 9), "small": (9, 1024, 9),
                            "medium": (18, 1024, 9), "large": (27, 1280, 16)}.items()}

# name -> (size, the parameter count Tables 1 and 5 print at sparsity 1)
MOSA_DENSE_ROWS: dict[str, tuple[str, str]] = {
    "c4-mosa-tiny-dense": ("tiny", "28M"),
    "c4-mosa-small-dense": ("small", "113M"),
    "c4-mosa-medium-dense": ("medium", "210M"),
    "c4-mosa-large-dense": ("large", "516M"),
}

# Table 5: name -> (size, sparsity rho, dense heads kept: 4 in the hybrid "MoSA" rows, 0 in
# "Pure MoSA", the parameter count the table prints). The MoSA head count is derived
# (mosa_isoflop_heads), not listed.
MOSA_ROWS: dict[str, tuple[str, int, int, str]] = {
    "c4-mosa-tiny-r2": ("tiny", 2, 4, "34M"),
    "c4-mosa-tiny-r4": ("tiny", 4, 4, "48M"),
    "c4-mosa-tiny-r8": ("tiny", 8, 4, "78M"),
    "c4-mosa-tiny-r16": ("tiny", 16, 4, "136M"),
    "c4-mosa-tiny-r32": ("tiny", 32, 4, "242M"),
    "c4-mosa-tiny-r64": ("tiny", 64, 4, "423M"),
    "c4-mosa-tiny-r128": ("tiny", 128, 4, "693M"),
    "c4-mosa-tiny-r256": ("tiny", 256, 4, "1B"),
    "c4-mosa-tiny-pure-r2": ("tiny", 2, 0, "39M"),
    "c4-mosa-tiny-pure-r4": ("tiny", 4, 0, "65M"),
    "c4-mosa-tiny-pure-r8": ("tiny", 8, 0, "119M"),
    "c4-mosa-tiny-pure-r16": ("tiny", 16, 0, "222M"),
    "c4-mosa-small-r2": ("small", 2, 4, "127M"),
    "c4-mosa-small-r4": ("small", 4, 4, "163M"),
    "c4-mosa-small-r8": ("small", 8, 4, "229M"),
    "c4-mosa-small-r16": ("small", 16, 4, "360M"),
    "c4-mosa-small-r32": ("small", 32, 4, "599M"),
    "c4-mosa-small-r64": ("small", 64, 4, "1B"),
    "c4-mosa-small-pure-r2": ("small", 2, 0, "142M"),
    "c4-mosa-small-pure-r4": ("small", 4, 0, "203M"),
    "c4-mosa-small-pure-r8": ("small", 8, 0, "324M"),
    "c4-mosa-small-pure-r16": ("small", 16, 0, "559M"),
    "c4-mosa-medium-r2": ("medium", 2, 4, "239M"),
    "c4-mosa-medium-r4": ("medium", 4, 4, "310M"),
    "c4-mosa-medium-r8": ("medium", 8, 4, "442M"),
    "c4-mosa-medium-r16": ("medium", 16, 4, "703M"),
    "c4-mosa-medium-r32": ("medium", 32, 4, "1.2B"),
    "c4-mosa-medium-pure-r2": ("medium", 2, 0, "267M"),
    "c4-mosa-medium-pure-r4": ("medium", 4, 0, "390M"),
    "c4-mosa-medium-pure-r8": ("medium", 8, 0, "632M"),
    "c4-mosa-medium-pure-r16": ("medium", 16, 0, "1.1B"),
    "c4-mosa-large-r2": ("large", 2, 4, "650M"),
    "c4-mosa-large-r4": ("large", 4, 4, "943M"),
    "c4-mosa-large-pure-r2": ("large", 2, 0, "703M"),
    "c4-mosa-large-pure-r4": ("large", 4, 0, "1B"),
}

# Table 2 (Sec. 3.3, perplexity-matched): name -> (size, sparsity, MoSA heads); 4 dense heads.
MOSA_MATCHED_ROWS: dict[str, tuple[str, int, int]] = {
    "c4-mosa-tiny-matched": ("tiny", 32, 17),
    "c4-mosa-small-matched": ("small", 32, 14),
    "c4-mosa-medium-matched": ("medium", 32, 12),
    "c4-mosa-large-matched": ("large", 16, 16),
}


def isoflop_heads(size: str, sparsity: int, dense_heads: int) -> int:
    """H_mosa of the Table 5 row (size, rho, 4 or 0 dense heads): mosa_isoflop_heads."""
    s = MOSA_SIZES[size]
    return mosa_isoflop_heads(n_layers=s.L, d_model=s.d, d_head=s.dense_d_head, T=s.T,
                              baseline_heads=s.dense_heads, sparsity=sparsity,
                              n_dense_heads=dense_heads)


def mosa_row(size: str, sparsity: int, dense_heads: int, H: int | None = None) -> ModelConfig:
    """A MoSA model of the paper's size ``size``: ``H`` MoSA heads (default: the IsoFLOP count)
    of h' = 64 with the first token always included, ``dense_heads`` dense RoPE heads, the
    baseline's feedforward."""
    s = MOSA_SIZES[size]
    if H is None:
        H = isoflop_heads(size, sparsity, dense_heads)
    return mosa_lm(s, H=H, d_h=s.dense_d_head, sparsity=sparsity, dense_heads=dense_heads,
                   d_ff=s.dense_d_ff, include_first=True)


def _dense_preset(name: str, size: str, label: str) -> Preset:
    s = MOSA_SIZES[size]
    desc = (f"C4 MoSA {size.capitalize()} dense RoPE baseline (Table 4, {label}): L={s.L} "
            f"d={s.d} H={s.dense_heads} d_h={s.dense_d_head} d_ff={s.dense_d_ff}")
    return paper(name, desc, lambda: dense_lm(s, H=s.dense_heads), data="c4", recipe=MOSA_C4)


def _isoflop_preset(name: str, size: str, rho: int, dense_heads: int, label: str) -> Preset:
    s = MOSA_SIZES[size]
    desc = (f"C4 {'MoSA' if dense_heads else 'pure MoSA'} {size.capitalize()} rho={rho} "
            f"(Table 5, {label}): {isoflop_heads(size, rho, dense_heads)} MoSA heads d_h=64 "
            f"k={s.T // rho} (first token kept)" + (" + 4 dense" if dense_heads else ""))
    return paper(name, desc, lambda: mosa_row(size, rho, dense_heads), data="c4",
                 recipe=MOSA_C4, baseline=f"c4-mosa-{size}-dense")


def _matched_preset(name: str, size: str, rho: int, H: int) -> Preset:
    s = MOSA_SIZES[size]
    desc = (f"C4 MoSA {size.capitalize()} perplexity-matched (Table 2): {H} MoSA heads d_h=64 "
            f"rho={rho} k={s.T // rho} (first token kept) + 4 dense")
    return paper(name, desc, lambda: mosa_row(size, rho, 4, H), data="c4", recipe=MOSA_C4,
                 baseline=f"c4-mosa-{size}-dense")


def _paper_presets() -> tuple[Preset, ...]:
    """The rows size by size: dense, hybrid, pure, perplexity-matched."""
    out: list[Preset] = []
    for size in MOSA_SIZES:
        out += [_dense_preset(n, size, label) for n, (sz, label) in MOSA_DENSE_ROWS.items()
                if sz == size]
        for pure in (False, True):
            out += [_isoflop_preset(n, size, rho, dh, label)
                    for n, (sz, rho, dh, label) in MOSA_ROWS.items()
                    if sz == size and (dh == 0) == pure]
        out += [_matched_preset(n, size, rho, H)
                for n, (sz, rho, H) in MOSA_MATCHED_ROWS.items() if sz == size]
    return tuple(out)


MOSA_PAPER_PRESETS: tuple[Preset, ...] = _paper_presets()

# Sec. 3.4 ("Scaling with Sequence Length", Fig. 4): long sequences with local attention in place
# of the dense heads: 6 layers of hidden size 1024, 60 MoSA heads and 4 local heads in every layer,
# k = 64 tokens per MoSA head at every length (rho = T / 64: 16 at T = 1024 to 128 at T = 8192).
# Not stated there, moeify's choices: h' = 64 and a 4h feedforward as in Table 4's sizes, the
# local window w = k = 64 (the authors' hybrid_type="local" sets window_size = k), the first
# token kept as in the IsoFLOP rows. The paper prints no parameter count for these models.
MOSA_LONG_K = 64


def mosa_long(T: int) -> ModelConfig:
    """Sec. 3.4's long-sequence MoSA model at context T (module comment above)."""
    s = Size(vocab=VOCAB_C4, d=1024, L=6, T=T, xl=False, dropout=0.0, dense_heads=0,
             dense_d_head=64, dense_d_ff=4 * 1024)
    attn = dataclasses.replace(
        mosa_attn(d=s.d, L=s.L, H=60, d_h=64, sparsity=T // MOSA_LONG_K, include_first=True),
        n_local_heads=4, local_window=MOSA_LONG_K)
    return lm(s, attn, dense_ff(d=s.d, L=s.L, d_ff=s.dense_d_ff, dropout=s.dropout))


def _long_preset(name: str, T: int) -> Preset:
    desc = (f"C4 MoSA long sequences (Sec. 3.4, Fig. 4) at T={T}: 6 layers d=1024, 60 MoSA "
            f"heads d_h=64 k={MOSA_LONG_K} (rho={T // MOSA_LONG_K}) + 4 local heads of window "
            f"{MOSA_LONG_K}")
    return paper(name, desc, lambda: mosa_long(T), data="c4", recipe=MOSA_C4)


MOSA_LONG_PRESETS: tuple[Preset, ...] = (
    _long_preset("c4-mosa-long-t1024", 1024), _long_preset("c4-mosa-long-t2048", 2048),
    _long_preset("c4-mosa-long-t4096", 4096), _long_preset("c4-mosa-long-t8192", 8192))

MOSA_PRESETS: tuple[Preset, ...] = MOSA_PAPER_PRESETS + MOSA_LONG_PRESETS + (
    Preset("tiny-mosa", "tiny RoPE: MoSA 32 sparse heads d_h=32 rho=8 (k=16) + 1 dense head, "
           "dense FFN d_ff=512 (attention MACs of 4 dense heads)", tiny_mosa),
    Preset("repro-mosa", "CPU-scale family (RoPE, no memory): MoSA 32 sparse heads d_h=32 "
           "rho=8 + 1 dense head, d_ff=512, MAC-matched to repro-rope-dense", repro_mosa,
           baseline="repro-rope-dense"),
    Preset("repro-mosa-paper", "CPU-scale family (RoPE, no memory): the MoSA paper's hybrid, "
           "4 dense heads + 40 MoSA heads d_h=16 rho=8 (k=16, first token always in), d_ff=512, "
           "FLOP-matched to repro-rope-dense by the paper's rule", repro_mosa_paper,
           baseline="repro-rope-dense"),
)
