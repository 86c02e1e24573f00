"""MoEUT presets (Csordás et al., NeurIPS 2024, arXiv 2405.16039): shared-layer Transformers of
SwitchHead attention (V and O experts, k = 2, RoPE on half of each head) and sigma-MoE
feedforwards (experts of 128, ReLU), peri-layernorm blocks (layers/moeut.py), layer grouping G.

The paper rows are the MoEUT configurations of the paper's C4 scaling experiments, named after
their parameter counts (44M, 126M, 244M, 318M, 727M, 1B), transcribed from the authors'
release of them (RobertCsordas/moeut, profiles.py: MoEUT_44M ... MoEUT_1B) with the C4 training
setting of their sweeps (RobertCsordas/moeut_training_code, sweeps/c4_moeut_*.yaml): context
1024, an 8000-token SentencePiece vocabulary, no dropout, batch 64, 4000 warm-up steps,
clipping 0.25, feedforward entropy regulariser gamma = 0.01. ``moeify count`` reproduces each
row's parameter count to the precision the name carries (tests/models/test_moeut_presets.py).
The 727M row takes d_model = 1280 from the authors' sweep where profiles.py says 1024 (which
would count 581.9M; see MOEUT_ROWS).

Deviations (README "The layers", MoEUT): the attention entropy regulariser (delta = 0.001 in
the authors' code) is not applied, since moeify's SwitchHead has none; the feedforward's entropy
regulariser is computed per layer application and summed, where the authors pool the
selection logits of all applications of a shared layer over the sequence before taking the
entropy; the untied output layer is initialised N(0, 1/d) with a zero bias (the library's
output layer), where the authors keep PyTorch's default Linear init.

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
# The authors' C4 recipe (sweeps/c4_moeut_*.yaml): batch 64, 4000 warm-up steps, clip 0.25.
MOEUT_C4 = PaperRecipe(batch_size=64, warmup_steps=4000, grad_clip=0.25)


def moeut_lm(*, vocab: int = VOCAB_C4, d: int, L: int, G: int, H: int, d_h: int, att_E: int,
             att_k: int = 2, ff_E: int, ff_k: int, expert_size: int = 128, T: int = 1024,
             entropy_coef: float = 0.01) -> ModelConfig:
    """A MoEUT model: L layer applications of G shared peri-layernorm blocks."""
    attn = SwitchHeadConfig(d_model=d, n_heads=H, d_head=d_h, n_experts=att_E, k=att_k,
                            pos="rope", n_layers=L)
    ff = SigmaMoEConfig(d_model=d, n_experts=ff_E, expert_size=expert_size, k=ff_k,
                        entropy_coef=entropy_coef, expert_dropout=0.0, n_layers=L)
    return ModelConfig(vocab_size=vocab, d_model=d, n_layers=L, context_length=T,
                       attention=attn, feedforward=ff, xl_memory=False, dropout=0.0,
                       group_size=G, block="peri_ln")


# name -> (the row's published size in parameters, the configuration)
MOEUT_ROWS: dict[str, tuple[str, dict]] = {
    "c4-44m-moeut": ("44M", dict(d=412, L=16, G=2, H=4, d_h=82, att_E=8, ff_E=155, ff_k=12)),
    "c4-126m-moeut": ("126M", dict(d=768, L=18, G=2, H=4, d_h=96, att_E=10, ff_E=254,
                                   ff_k=12)),
    "c4-244m-moeut": ("244M", dict(d=1024, L=18, G=2, H=4, d_h=128, att_E=10, ff_E=387,
                                   ff_k=16)),
    "c4-318m-moeut": ("318M", dict(d=1024, L=24, G=3, H=4, d_h=128, att_E=10, ff_E=338,
                                   ff_k=16)),
    # d = 1280 as in the authors' training sweep of this row (sweeps/c4_moeut_gigantic_
    # switchead.yaml: state_size 1280); their profiles.py says d_model=1024, which counts 581.9M,
    # not the 727M the row is named after (a transcription slip there; 1280 gives 727.4M).
    "c4-727m-moeut": ("727M", dict(d=1280, L=36, G=4, H=5, d_h=128, att_E=13, ff_E=467,
                                   ff_k=20)),
    "c4-1b-moeut": ("1B", dict(d=1536, L=36, G=4, H=6, d_h=128, att_E=12, ff_E=565,
                                  ff_k=24)),
}


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
    # SwitchHead H = 2, E = 4, k = 2 matched to repro-rope-dense (spec §5), so the follow-ups
    # are compared with both of their predecessors at the same positional encoding.
    return match_attention(repro_rope_dense(), n_heads=2, n_experts=4, k=2).config


def repro_moeut() -> ModelConfig:
    # G = 2 as the paper's small rows; parameter-matched to repro-rope-dense as the paper's
    # MoEUT rows are to their dense baselines: the sigma-MoE's 19 experts of 64 (k = 2) absorb
    # what sharing removes (862,464 vs 857,088 parameters, +0.6%; tests check 1%).
    return moeut_lm(vocab=256, d=128, L=4, G=2, H=2, d_h=32, att_E=4, ff_E=19, ff_k=2,
                    expert_size=64, T=128, entropy_coef=0.01)


def _row(name: str, size: str, kw: dict) -> Preset:
    desc = (f"C4 MoEUT {size} (paper's scaling rows): L={kw['L']} G={kw['G']} d={kw['d']}, "
            f"SwitchHead H={kw['H']} d_h={kw['d_h']} E={kw['att_E']} k=2, sigma-MoE "
            f"{kw['ff_E']} x 128 k={kw['ff_k']}, peri-layernorm")
    return paper(name, desc, lambda: moeut_lm(**kw), data="c4", recipe=MOEUT_C4)


MOEUT_PRESETS: tuple[Preset, ...] = tuple(_row(n, s, kw) for n, (s, kw) in MOEUT_ROWS.items()) + (
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
