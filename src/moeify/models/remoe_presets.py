"""ReMoE presets (Wang et al., ICLR 2025, arXiv 2412.14711; layers/remoe.py).

Paper rows: the LLaMA models of the authors' scripts (thu-ml/ReMoE, scripts/train_llama_*_remoe.sh)
at E = 8 experts and target k = 1: 182M (12 layers, d = 768, 12 heads), 469M (24 layers,
d = 1024, 16 heads) and 978M (24 layers, d = 1536, 16 heads); RMSNorm, RoPE, untied embeddings,
context 1024, every expert a SwiGLU MLP of the dense model's width 4d (granularity 1), init std
0.01, lambda_0 = 1e-8, alpha = 1.2; the GPT-2 vocabulary padded to a multiple of 1024 (51,200).
The sizes name the dense models with the experts' active parameters (the paper's naming); the
preset's own parameter count is the MoE's total (``moeify count``).

``repro-remoe`` is the CPU-study row, built from ``repro-rope-dense`` (d = 128, L = 4, 8 heads
of 16, ReLU d_ff 512) by replacing each dense MLP with ReMoE over 8 ReLU experts of 64 hidden
units (the dense MLP's parameters split, plus a router of 8 x 128), target k = 2: at the
target, a quarter of the dense MLP's MACs, the sparsity of the study's sigma-MoE rows. Its init
std is the study family's for input weights (sigma-MoE's s / sqrt(d), s = sqrt(2 / L): 0.0625),
not the authors' 0.01, which is sized for their d >= 768: at d = 128 with 0.01, a 120-step trial
of the study recipe lost two of the four layers' routers by step 40 (0.00 and 0.01 experts per
token while lambda was still 2e-6: every router output negative, which a ReLU router does not
recover from, as nothing reaches its weights), and ended at 4.21 bpc; with 0.0625 every layer
kept 1 to 3.4 experts per token around the target and it ended at 4.08 bpc.
"""

from __future__ import annotations

import dataclasses

from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.common import init_scale
from moeify.layers.norm import NormConfig
from moeify.layers.remoe import ReMoEConfig
from moeify.models.config import ModelConfig
from moeify.models.moeut_presets import repro_rope_dense
from moeify.models.registry import Preset

LLAMA_ROWS = {"182m": dict(L=12, d=768, H=12), "469m": dict(L=24, d=1024, H=16),
              "978m": dict(L=24, d=1536, H=16)}


def remoe_llama(size: str) -> ModelConfig:
    r = LLAMA_ROWS[size]
    d, L = r["d"], r["L"]
    attn = DenseAttentionConfig(d_model=d, n_heads=r["H"], d_head=d // r["H"], pos="rope",
                                n_layers=L)
    ff = ReMoEConfig(d_model=d, n_experts=8, expert_size=4 * d, k=1, n_layers=L)
    return ModelConfig(vocab_size=51200, d_model=d, n_layers=L, context_length=1024,
                       attention=attn, feedforward=ff, xl_memory=False,
                       norm=NormConfig(kind="rmsnorm", eps=1e-5, bias=False),
                       tie_embeddings=False, output_bias=False)


def repro_remoe() -> ModelConfig:
    base = repro_rope_dense()
    ff = ReMoEConfig(d_model=base.d_model, n_experts=8, expert_size=64, k=2, gated=False,
                     activation="relu", n_layers=base.n_layers,
                     init_std=init_scale(base.n_layers) / base.d_model ** 0.5)
    return dataclasses.replace(base, feedforward=ff)


REMOE_PRESETS: tuple[Preset, ...] = (
    Preset("remoe-182m", "ReMoE paper: LLaMA 182M (L=12, d=768, H=12), 8 SwiGLU experts of 4d, "
           "ReLU routing at target k=1", lambda: remoe_llama("182m")),
    Preset("remoe-469m", "ReMoE paper: LLaMA 469M (L=24, d=1024, H=16), 8 SwiGLU experts of "
           "4d, ReLU routing at target k=1", lambda: remoe_llama("469m")),
    Preset("remoe-978m", "ReMoE paper: LLaMA 978M (L=24, d=1536, H=16), 8 SwiGLU experts of "
           "4d, ReLU routing at target k=1", lambda: remoe_llama("978m")),
    Preset("repro-remoe", "CPU-scale family (RoPE, no memory): repro-rope-dense with ReMoE "
           "feedforwards, 8 ReLU experts of 64, target k=2", repro_remoe,
           baseline="repro-rope-dense"),
)
