"""MoEUT presets (Csordás et al., NeurIPS 2024, arXiv 2405.16039): shared-layer Transformers of
SwitchHead attention (V and O experts, k = 2, RoPE on half of each head) and sigma-MoE
feedforwards (experts of 128, ReLU), peri-layernorm blocks (layers/moeut.py), layer grouping G.

The paper rows are the C4 rows of the paper's main results table (perplexity and zero-shot
accuracy, MoEUT beside its parameter-matched dense baseline per size), named after that table's
#params column: 44M, 126M, 244M, 319M, 728M, 1040M. The paper's text is not readable here; the
rows are taken from the authors' script that renders the table (RobertCsordas/
moeut_training_code, paper/moe_universal/main_result_table.py): its runs per row (C4: the
``small`` / ``mid`` / ``big`` / ``bigger`` / ``gigantic`` / ``1b`` sweeps, baseline and MoEUT)
and its #params column, each run's parameter count mapped to the nearest of {44, 126, 244, 319,
728, 1040} (so one label per size, shared by the baseline and the MoEUT row). The configurations
are those sweeps' (sweeps/c4_moeut_*.yaml, c4_baseline_*_rope_nodrop.yaml; the MoEUT ones equal
RobertCsordas/moeut profiles.py but for the 728M row's d_model, see MOEUT_ROWS) with their C4
setting: context 1024, an 8000-token SentencePiece vocabulary, no dropout, batch 64, 4000
warm-up steps and clipping 0.25 (the 44M rows: no warm-up, clipping 0.1), regularisers
gamma = 0.01 (sigma-MoE) and delta = 0.001 (attention),
both ``perplexity_reg_mode: layers_time``. ``moeify count`` puts every MoEUT row within 0.9M of
its label and every baseline within 0.7M, but the 1040M baseline (1044.3M: the label is the
MoEUT's); tests/models/test_moeut_presets.py holds each row to it. The same configurations are
the paper's hyperparameter table (rendered by paper/moe_universal/plot_hyperparams.py: #params,
n_layers, G, d_model, d_ff, H, N_A, d_head, N_E, K, warm-up, clipping per run).

That table has a third run per size (but 1040M), with G = n_layers, i.e. no layer sharing, and
one attention expert; the script labels a run "sigma-MoE" when G == n_layers and
moe.att.n_experts == 1, which all five meet, so their presets are ``c4-{size}-sigma-moe-g{G}``
(SIGMA_MOE_ROWS; 44M g16, 126M g18, 244M g18, 319M g24, 728M g36), with the size's dense
baseline and the same recipe. Each sweep is its size's MoEUT sweep but for G = L,
moe.att.n_experts = 1 with moe.att.k = 1, and fewer sigma-MoE experts (17, 26, 40, 40, 50);
their layer-norm scheme is the MoEUT rows' (``moe.nonorm: 1``, peri-layernorm, in every one of
these sweeps, whatever 'noln' / 'nonorm' / 'preln' their names say). That table's printed
#params could not be read here (it prints each run's count rounded to the million, not a
label): ``moeify count`` puts four of them within 0.7M of their size's label (44.13M, 126.07M,
243.84M, 319.66M) and the 728M one at 731.2M (its sweep, d_model 1280 and 36 layers of 50
experts; 728 is still the nearest label); the tests hold them to these counts and labels, not to
printed figures.

The regularisers are the authors' (SigmaMoEConfig.entropy_pool = "sequence", SwitchHeadConfig
.entropy_coef), pooled per sequence over the applications of a shared block. The
initialisation, and its one deviation (the output layer), are said in moeify.layers.moeut.

``tiny-moeut`` is the tiny family's shape (byte vocabulary, d = 128, T = 128) with 4 layers in
2 groups; ``repro-moeut`` is its CPU-study counterpart, parameter-matched to ``repro-rope-dense``
(the repro family's dense model without XL memory, also MoSA's baseline).
"""

from __future__ import annotations

from moeify.layers.feedforward import SigmaMoEConfig
from moeify.layers.switchhead import SwitchHeadConfig
from moeify.models.builders import Size, dense_lm
from moeify.models.config import ModelConfig
from moeify.models.match import match_attention
from moeify.models.registry import PaperRecipe, Preset, paper

VOCAB_C4 = 8000
# The authors' C4 recipe (sweeps/c4_moeut_*.yaml, c4_baseline_*_rope_nodrop.yaml): batch 64,
# 4000 warm-up steps, clip 0.25; the 44M sweeps (``small``, baseline, MoEUT and sigma-MoE alike)
# clip at 0.1 and set no warm-up (their framework's default lr_warmup is 0).
MOEUT_C4 = PaperRecipe(batch_size=64, warmup_steps=4000, grad_clip=0.25)
MOEUT_C4_44M = PaperRecipe(batch_size=64, warmup_steps=0, grad_clip=0.1)


def _recipe(name: str) -> PaperRecipe:
    return MOEUT_C4_44M if name.startswith("c4-44m-") else MOEUT_C4


def moeut_lm(*, vocab: int = VOCAB_C4, d: int, L: int, G: int, H: int, d_h: int, att_E: int,
             att_k: int = 2, ff_E: int, ff_k: int, expert_size: int = 128, T: int = 1024,
             entropy_coef: float = 0.01, att_entropy_coef: float = 0.001) -> ModelConfig:
    """A MoEUT model: L layer applications of G shared peri-layernorm blocks. Regularisers as
    the authors' MoEUT (moeut.py: ``entropy_reg=0.01``, ``att_entropy_reg=0.001``, their sweeps'
    ``moe.perplexity_reg`` and ``moe.att.perplexity_reg``): gamma = ``entropy_coef`` on the
    sigma-MoE selection and delta = ``att_entropy_coef`` on the V and O selections, each pooled
    per sequence over the applications of a shared block (``perplexity_reg_mode: layers_time``)."""
    attn = SwitchHeadConfig(d_model=d, n_heads=H, d_head=d_h, n_experts=att_E, k=att_k,
                            pos="rope", n_layers=L, entropy_coef=att_entropy_coef)
    ff = SigmaMoEConfig(d_model=d, n_experts=ff_E, expert_size=expert_size, k=ff_k,
                        entropy_coef=entropy_coef, expert_dropout=0.0, n_layers=L,
                        entropy_pool="sequence")
    return ModelConfig(vocab_size=vocab, d_model=d, n_layers=L, context_length=T,
                       attention=attn, feedforward=ff, xl_memory=False, dropout=0.0,
                       group_size=G, block="peri_ln")


# name -> (the row's #params label in the paper's main results table, the configuration).
# The authors' sweep per row (RobertCsordas/moeut_training_code sweeps/, C4):
MOEUT_ROWS: dict[str, tuple[str, dict]] = {
    # c4_moeut_small_matched_rope_noln_long
    "c4-44m-moeut": ("44M", dict(d=412, L=16, G=2, H=4, d_h=82, att_E=8, ff_E=155, ff_k=12)),
    # c4_moeut_mid_matched_rope_noln
    "c4-126m-moeut": ("126M", dict(d=768, L=18, G=2, H=4, d_h=96, att_E=10, ff_E=254,
                                   ff_k=12)),
    # c4_moeut_big_matched_rope_preln_linear_norot_nosm1
    "c4-244m-moeut": ("244M", dict(d=1024, L=18, G=2, H=4, d_h=128, att_E=10, ff_E=387,
                                   ff_k=16)),
    # c4_moeut_bigger_matched_rope_nonorm_g3
    "c4-319m-moeut": ("319M", dict(d=1024, L=24, G=3, H=4, d_h=128, att_E=10, ff_E=338,
                                   ff_k=16)),
    # c4_moeut_gigantic_switchead: state_size 1280; the authors' profiles.py says d_model=1024
    # for this row (MoEUT_727M), which counts 581.9M, not the 728M of the table (a
    # transcription slip there; 1280 gives 727.4M).
    "c4-728m-moeut": ("728M", dict(d=1280, L=36, G=4, H=5, d_h=128, att_E=13, ff_E=467,
                                   ff_k=20)),
    # c4_moeut_1b_switchead
    "c4-1040m-moeut": ("1040M", dict(d=1536, L=36, G=4, H=6, d_h=128, att_E=12, ff_E=565,
                                     ff_k=24)),
}

# name -> (the #params label of its size, the configuration): the third run per size of the
# paper's hyperparameter table (paper/moe_universal/plot_hyperparams.py), G = n_layers, i.e. no
# layer sharing, with one attention expert (V and O each a single gated projection per head,
# k = 1). That script labels a run "sigma-MoE" when G == n_layers and moe.att.n_experts == 1,
# which all five meet, hence the names. Each sweep equals its size's MoEUT sweep (same d_model,
# L, H, d_head, k, expert size 128, regularisers, ``moe.nonorm: 1`` = peri-layernorm, recipe)
# but for transformer.universal.group_size = L, moe.att.n_experts = 1, moe.att.k = 1 and fewer
# sigma-MoE experts (L / G times more blocks to fill). The 'noln' / 'nonorm' / 'switchead' in
# the sweep names are not options: every one of these sweeps, and every MoEUT sweep, sets
# ``moe.nonorm: 1``. The authors' FullMoeRopeAttention keeps its selection gates with one
# expert (a sigmoid-gated V and O per head, H x d gate rows each), as SwitchHeadConfig does.
# The 1B size has no such run. The authors' sweeps:
SIGMA_MOE_ROWS: dict[str, tuple[str, dict]] = {
    # c4_moeut_small_matched_rope_noln_long_g16 (MoEUT row: G 2, 8 attention experts k 2, 155)
    "c4-44m-sigma-moe-g16": ("44M", dict(d=412, L=16, G=16, H=4, d_h=82, att_E=1, att_k=1,
                                         ff_E=17, ff_k=12)),
    # c4_moeut_mid_matched_rope_noln_g18 (MoEUT row: G 2, 10 attention experts k 2, 254)
    "c4-126m-sigma-moe-g18": ("126M", dict(d=768, L=18, G=18, H=4, d_h=96, att_E=1, att_k=1,
                                           ff_E=26, ff_k=12)),
    # c4_moeut_big_matched_rope_noln_g18 (MoEUT row: G 2, 10 attention experts k 2, 387)
    "c4-244m-sigma-moe-g18": ("244M", dict(d=1024, L=18, G=18, H=4, d_h=128, att_E=1, att_k=1,
                                           ff_E=40, ff_k=16)),
    # c4_moeut_bigger_matched_rope_nonorm_g24 (MoEUT row: G 3, 10 attention experts k 2, 338)
    "c4-319m-sigma-moe-g24": ("319M", dict(d=1024, L=24, G=24, H=4, d_h=128, att_E=1, att_k=1,
                                           ff_E=40, ff_k=16)),
    # c4_moeut_gigantic_switchead_g36 (MoEUT row: G 4, 13 attention experts k 2, 467); counts
    # 731.2M, 3.2M over its label (still the nearest of the six).
    "c4-728m-sigma-moe-g36": ("728M", dict(d=1280, L=36, G=36, H=5, d_h=128, att_E=1, att_k=1,
                                           ff_E=50, ff_k=20)),
}

# name -> (label, (d, L, H, d_ff)) of the dense RoPE baselines of the same table rows
# (sweeps c4_baseline_{small_rope_long,mid_rope,big_rope,bigger_rope,gigantic_rope,1b_rope}
# _nodrop: pre-LN, RoPE on half of each head, bias-free attention, ReLU MLP with biases,
# d_ff = int(d_model * ff_multiplier), d_head = d_model / H except the 44M's 41).
MOEUT_BASELINE_ROWS: dict[str, tuple[str, tuple[int, int, int, int, int]]] = {
    "c4-44m-rope-dense": ("44M", (412, 16, 10, 41, int(412 * 4.985))),
    "c4-126m-rope-dense": ("126M", (768, 16, 16, 48, 3072)),
    "c4-244m-rope-dense": ("244M", (1024, 18, 16, 64, int(1024 * 4.014))),
    "c4-319m-rope-dense": ("319M", (1024, 24, 16, 64, int(1024 * 4.014))),
    "c4-728m-rope-dense": ("728M", (1280, 36, 20, 64, 5120)),
    "c4-1040m-rope-dense": ("1040M", (1536, 36, 24, 64, 6144)),
}


def moeut_baseline(d: int, L: int, H: int, d_h: int, d_ff: int) -> ModelConfig:
    return dense_lm(Size(vocab=VOCAB_C4, d=d, L=L, T=1024, xl=False, dropout=0.0, dense_heads=H,
                         dense_d_head=d_h, dense_d_ff=d_ff), H=H)


def tiny_moeut() -> ModelConfig:
    return moeut_lm(vocab=256, d=128, L=4, G=2, H=2, d_h=32, att_E=4, ff_E=8, ff_k=2,
                    expert_size=64, T=128, entropy_coef=0.01)


# The CPU-study shape of models/repro_presets.py (byte vocabulary, d = 128, L = 4, T = 128)
# without XL memory: MoEUT and MoSA are RoPE models, so their baseline is this dense RoPE model.
REPRO_ROPE = Size(vocab=256, d=128, L=4, T=128,
                  xl=False, dropout=0.0, dense_heads=8, dense_d_head=16, dense_d_ff=512)


def repro_rope_dense() -> ModelConfig:
    return dense_lm(REPRO_ROPE, H=8)


def repro_rope_switchhead() -> ModelConfig:
    # SwitchHead H = 2, E = 4, k = 2 matched to repro-rope-dense (SwitchHead §3), so the follow-ups
    # are compared with both of their predecessors at the same positional encoding.
    return match_attention(repro_rope_dense(), n_heads=2, n_experts=4, k=2).config


def repro_moeut() -> ModelConfig:
    # G = 2 as the paper's small rows; parameter-matched to repro-rope-dense as the paper's
    # MoEUT rows are to their dense baselines: the sigma-MoE's 19 experts of 64 (k = 2) absorb
    # what sharing removes (862,464 vs 857,088 parameters, +0.6%; tests check 1%).
    return moeut_lm(vocab=256, d=128, L=4, G=2, H=2, d_h=32, att_E=4, ff_E=19, ff_k=2,
                    expert_size=64, T=128, entropy_coef=0.01)


def _row(name: str, size: str, kw: dict) -> Preset:
    desc = (f"C4 MoEUT {size} (main results table): L={kw['L']} G={kw['G']} d={kw['d']}, "
            f"SwitchHead H={kw['H']} d_h={kw['d_h']} E={kw['att_E']} k=2, sigma-MoE "
            f"{kw['ff_E']} x 128 k={kw['ff_k']}, peri-layernorm")
    base = name.replace("-moeut", "-rope-dense")
    return paper(name, desc, lambda: moeut_lm(**kw), data="c4", recipe=_recipe(name),
                 baseline=base)


def _sigma_row(name: str, size: str, kw: dict) -> Preset:
    desc = (f"C4 sigma-MoE {size} (hyperparameter table, G = n_layers, no sharing): "
            f"L={kw['L']} G={kw['G']} d={kw['d']}, SwitchHead H={kw['H']} d_h={kw['d_h']} "
            f"E=1 k=1, sigma-MoE {kw['ff_E']} x 128 k={kw['ff_k']}, peri-layernorm")
    base = name.split("-sigma-moe")[0] + "-rope-dense"
    return paper(name, desc, lambda: moeut_lm(**kw), data="c4", recipe=_recipe(name),
                 baseline=base)


def _baseline_row(name: str, size: str, shape: tuple[int, int, int, int, int]) -> Preset:
    d, L, H, d_h, d_ff = shape
    desc = (f"C4 dense RoPE baseline {size} of MoEUT's main results table: L={L} d={d} H={H} "
            f"d_h={d_h} d_ff={d_ff}")
    return paper(name, desc, lambda: moeut_baseline(*shape), data="c4", recipe=_recipe(name))


MOEUT_PRESETS: tuple[Preset, ...] = tuple(
    _baseline_row(n, s, shape) for n, (s, shape) in MOEUT_BASELINE_ROWS.items()) + tuple(
    _row(n, s, kw) for n, (s, kw) in MOEUT_ROWS.items()) + tuple(
    _sigma_row(n, s, kw) for n, (s, kw) in SIGMA_MOE_ROWS.items()) + (
    Preset("tiny-moeut", "tiny RoPE: MoEUT, 4 layers in G=2 shared peri-layernorm blocks: "
           "SwitchHead H=2 d_h=32 E=4 k=2 + sigma-MoE 8 x 64 k=2", tiny_moeut),
    Preset("repro-rope-dense", "CPU-scale family without XL memory: dense RoPE H=8 d_h=16, "
           "d_ff=512 (the baseline of repro-moeut and repro-mosa)", repro_rope_dense),
    Preset("repro-rope-switchhead", "CPU-scale family without XL memory: SwitchHead RoPE "
           "H=2 E=4 k=2, d_h and d_ff matched to repro-rope-dense", repro_rope_switchhead,
           baseline="repro-rope-dense"),
    Preset("repro-moeut", "CPU-scale family (RoPE, no memory): MoEUT, 4 layers in G=2 shared "
           "blocks, SwitchHead H=2 d_h=32 E=4 k=2 + sigma-MoE 19 x 64 k=2, matched to "
           "repro-rope-dense", repro_moeut, baseline="repro-rope-dense"),
)
