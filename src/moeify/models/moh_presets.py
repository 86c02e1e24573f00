"""MoH presets (Jin et al., ICML 2025, arXiv 2410.11842v3): multi-head attention whose heads are
experts, each token using the h_s shared heads and K of the routed ones (moeify.layers.moh),
with the load-balance loss at β = 0.01 (Eq. 8, "for all tasks"; MoHConfig's default).

The paper's language-model rows (Sec. 4.3, "Training LLMs from Scratch"; the appendix's Tab. C
prints layers, hidden size, intermediate size, heads, head dim and #Params):

    ``moh-llm-s-dense``  LLM-S, 186M: 12 layers, d 768, SwiGLU 2048, 12 heads of 64
    ``moh-llm-s-75``     MoH-LLM-S, 186M, 75% of the heads active
    ``moh-llm-s-50``     MoH-LLM-S, 186M, 50% of the heads active
    ``moh-llm-b-dense``  LLM-B, 881M: 24 layers, d 1536, SwiGLU 4096, 16 heads of 96
    ``moh-llm-b-75``     MoH-LLM-B, 882M, 75% active
    ``moh-llm-b-50``     MoH-LLM-B, 882M, 50% active

Not printed by the paper, moeify's assumptions: the LLaMA form (RMSNorm, SwiGLU, RoPE over the
whole head, no biases), an untied output layer and a vocabulary of 65,536; with them
``moeify count`` gives 185.6M / 185.7M / 880.9M / 881.5M, the table's 186 / 186 / 881 / 882
(tests/models/test_moh_presets.py, against the printed numbers). The MoH layers add per layer
W_r, W_s and W_h, (h - h_s)·d + h_s·d + 2·d = (h + 2)·d parameters whatever the split. The split
between shared and routed heads of the LLM rows is not printed either: moeify takes the one of
the paper's continue-tuned LLaMA3-8B (Sec. 4.4: the first 16 of 32 heads shared) and the
authors' MoH-LLaMA3-8B code (shared = h/2, and the routed heads kept making up the rest of the
active share: 75% -> K = h/4; 50% -> shared h/4, K = h/4). The training mix (RedPajama,
Dolma, Pile), sequence length 2048 and 4M-token batches are the paper's; no corpus or recipe is
attached here.

``tiny-moh`` (byte vocabulary, d 128, 4 layers, T 128): 4 heads of 32, 1 shared + 2 of 3 routed
(75% active). ``repro-moh`` is the CPU study's MoH row: ``repro-rope-dense``'s attention (8
RoPE heads of 16) as MoH with 4 shared heads and 2 of the other 4 per token (75% of the heads,
the paper's main setting), the same feedforward: the paper's comparison, same heads and
parameters (+(h + 2)·d = 1,280 per layer, +0.6%), fewer heads active.
"""

from __future__ import annotations

import dataclasses

from moeify.layers.mlp import GatedMLPConfig
from moeify.layers.moh import MoHConfig
from moeify.layers.norm import NormConfig
from moeify.models.builders import Size, dense_attn, dense_ff, lm
from moeify.models.config import ModelConfig
from moeify.models.registry import Preset

TINY_ROPE = Size(vocab=256, d=128, L=4, T=128,
                 xl=False, dropout=0.0, dense_heads=4, dense_d_head=32, dense_d_ff=512)
REPRO_ROPE = Size(vocab=256, d=128, L=4, T=128,
                  xl=False, dropout=0.0, dense_heads=8, dense_d_head=16, dense_d_ff=512)


def moh_attn(*, d: int, L: int, H: int, d_h: int, shared: int, k: int, pos: str = "rope",
             rope_fraction: float = 0.5) -> MoHConfig:
    return MoHConfig(d_model=d, n_heads=H, d_head=d_h, n_shared=shared, k=k, pos=pos,
                     n_layers=L, rope_fraction=rope_fraction)


def tiny_moh() -> ModelConfig:
    s = TINY_ROPE
    return lm(s, moh_attn(d=s.d, L=s.L, H=4, d_h=32, shared=1, k=2),
              dense_ff(d=s.d, L=s.L, d_ff=s.dense_d_ff, dropout=0.0))


def repro_moh() -> ModelConfig:
    s = REPRO_ROPE
    return lm(s, moh_attn(d=s.d, L=s.L, H=s.dense_heads, d_h=s.dense_d_head, shared=4, k=2),
              dense_ff(d=s.d, L=s.L, d_ff=s.dense_d_ff, dropout=0.0))


# ---------------------------------------------------------------------------- the paper's rows

MOH_VOCAB = 65536  # assumed (module docstring)
MOH_T = 2048
# size -> (layers, hidden, intermediate, heads, head dim), the appendix's Tab. C
MOH_LLM_SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "s": (12, 768, 2048, 12, 64),
    "b": (24, 1536, 4096, 16, 96),
}
# name -> (size, active share in %, or None for the dense baseline; #Params the table prints)
MOH_LLM_ROWS: dict[str, tuple[str, int | None, str]] = {
    "moh-llm-s-dense": ("s", None, "186M"),
    "moh-llm-s-75": ("s", 75, "186M"),
    "moh-llm-s-50": ("s", 50, "186M"),
    "moh-llm-b-dense": ("b", None, "881M"),
    "moh-llm-b-75": ("b", 75, "882M"),
    "moh-llm-b-50": ("b", 50, "882M"),
}


def llm_split(H: int, active: int) -> tuple[int, int]:
    """(h_s, K) for an active share of 75 or 50 percent (module docstring)."""
    if active == 75:
        return H // 2, H // 4
    if active == 50:
        return H // 4, H // 4
    raise ValueError(f"the paper's LLM rows activate 75 or 50 percent of the heads, got {active}")


def moh_llm(size: str, active: int | None) -> ModelConfig:
    """The paper's LLM-S / LLM-B (``active`` None) or MoH-LLM with that share of heads active."""
    L, d, d_ff, H, d_h = MOH_LLM_SIZES[size]
    if active is None:
        attn = dense_attn(d=d, L=L, H=H, d_h=d_h, pos="rope")
    else:
        shared, k = llm_split(H, active)
        attn = moh_attn(d=d, L=L, H=H, d_h=d_h, shared=shared, k=k)
    attn = dataclasses.replace(attn, rope_fraction=1.0)  # LLaMA: RoPE over the whole head
    return ModelConfig(vocab_size=MOH_VOCAB, d_model=d, n_layers=L, context_length=MOH_T,
                       attention=attn,
                       feedforward=GatedMLPConfig(d_model=d, d_ff=d_ff, n_layers=L),
                       xl_memory=False, norm=NormConfig(kind="rmsnorm", bias=False),
                       output_bias=False)


def _row(name: str, size: str, active: int | None, label: str) -> Preset:
    L, d, d_ff, H, d_h = MOH_LLM_SIZES[size]
    if active is None:
        desc = (f"MoH paper's LLM-{size.upper()} dense baseline ({label}): L={L} d={d} "
                f"SwiGLU {d_ff}, {H} RoPE heads d_h={d_h}, vocab {MOH_VOCAB} (assumed)")
        return Preset(name, desc, lambda: moh_llm(size, None))
    shared, k = llm_split(H, active)
    desc = (f"MoH paper's MoH-LLM-{size.upper()} {active}% heads ({label}): L={L} d={d} "
            f"SwiGLU {d_ff}, MoH {H} heads d_h={d_h}, {shared} shared + {k} of {H - shared} "
            f"routed, vocab {MOH_VOCAB} (assumed)")
    return Preset(name, desc, lambda: moh_llm(size, active),
                  baseline=f"moh-llm-{size}-dense")


MOH_PAPER_PRESETS: tuple[Preset, ...] = tuple(
    _row(n, size, active, label) for n, (size, active, label) in MOH_LLM_ROWS.items())

MOH_PRESETS: tuple[Preset, ...] = MOH_PAPER_PRESETS + (
    Preset("tiny-moh", "tiny RoPE: MoH 4 heads d_h=32, 1 shared + 2 of 3 routed (75% active), "
           "dense FFN d_ff=512", tiny_moh),
    Preset("repro-moh", "CPU-scale family (RoPE, no memory): MoH 8 heads d_h=16, 4 shared + 2 "
           "of 4 routed (75% active), d_ff=512: repro-rope-dense's heads and parameters "
           "(+0.6%)", repro_moh, baseline="repro-rope-dense"),
)
