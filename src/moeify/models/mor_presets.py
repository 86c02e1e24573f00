"""Mixture-of-Recursions presets (Bae et al., NeurIPS 2025, arXiv 2507.10524; layers/recursion.py).

Paper rows: the SmolLM-360M base of the paper's main comparison at fixed FLOPs (Table 3), a
Llama architecture (the authors' HuggingFaceTB/SmolLM-360M config: d = 960, 32 layers, 15 query
heads of 64 with 5 key/value heads, SwiGLU d_ff = 2560, RMSNorm, RoPE, tied embeddings,
vocabulary 49,152, context 2048). The vanilla model has 315M non-embedding parameters; MoR with
N_r = 3 and Middle-Cycle sharing keeps the first and last layer and one stack of (32 - 2) / 3 =
10 layers, 118M non-embedding parameters as the paper prints (plus its three routers, 2,880).
Expert-choice (the paper's best) and token-choice rows share the shape; the routing settings are
the authors' configurations for these rows (expert: alpha 0.1 sigmoid, BCE aux loss 0.001;
token: softmax, balancing loss 0.1, z-loss 1e-5).

``repro-mor`` is the CPU-study counterpart, built from ``repro-rope-dense`` the way the paper
builds MoR from its vanilla base: the same shape (d = 128, L = 4, 8 heads of 16, d_ff 512),
Middle-Cycle with N_r = 2 (the first and last block unshared, one block applied twice),
expert-choice with capacities (1, 1/2): three quarters of the dense model's block parameters.
"""

from __future__ import annotations

import dataclasses

from moeify.layers.gqa import GroupedQueryAttentionConfig
from moeify.layers.mlp import GatedMLPConfig
from moeify.layers.norm import NormConfig
from moeify.layers.recursion import MoRConfig
from moeify.models.config import ModelConfig
from moeify.models.moeut_presets import repro_rope_dense
from moeify.models.registry import Preset

SMOLLM_360M = dict(vocab=49152, d=960, L=32, H=15, Hk=5, d_h=64, d_ff=2560, T=2048)


def smollm_360m(recursion: MoRConfig | None = None) -> ModelConfig:
    s = SMOLLM_360M
    attn = GroupedQueryAttentionConfig(d_model=s["d"], n_heads=s["H"], n_kv_heads=s["Hk"],
                                       d_head=s["d_h"], pos="rope", n_layers=s["L"])
    ff = GatedMLPConfig(d_model=s["d"], d_ff=s["d_ff"], n_layers=s["L"])
    return ModelConfig(vocab_size=s["vocab"], d_model=s["d"], n_layers=s["L"],
                       context_length=s["T"], attention=attn, feedforward=ff, xl_memory=False,
                       norm=NormConfig(kind="rmsnorm", eps=1e-5, bias=False),
                       tie_embeddings=True, output_bias=False, recursion=recursion)


def mor_360m(routing: str) -> ModelConfig:
    return smollm_360m(MoRConfig(d_model=SMOLLM_360M["d"], n_recursions=3, routing=routing))


def repro_mor(routing: str = "expert") -> ModelConfig:
    base = repro_rope_dense()
    return dataclasses.replace(base, recursion=MoRConfig(d_model=base.d_model, n_recursions=2,
                                                         routing=routing))


MOR_PRESETS: tuple[Preset, ...] = (
    Preset("mor-360m-vanilla", "MoR paper Table 3 vanilla baseline: SmolLM-360M (Llama, d=960, "
           "32 layers, GQA 15/5 x 64, SwiGLU 2560), 315M non-embedding parameters", smollm_360m),
    Preset("mor-360m-expert", "MoR paper Table 3: SmolLM-360M base, N_r=3 Middle-Cycle, "
           "expert-choice (alpha 0.1 sigmoid, BCE aux loss), 118M non-embedding parameters",
           lambda: mor_360m("expert"), baseline="mor-360m-vanilla"),
    Preset("mor-360m-token", "MoR paper: SmolLM-360M base, N_r=3 Middle-Cycle, token-choice "
           "(softmax, balancing loss 0.1, z-loss 1e-5), 118M non-embedding parameters",
           lambda: mor_360m("token"), baseline="mor-360m-vanilla"),
    Preset("repro-mor", "CPU-scale family (RoPE, no memory): repro-rope-dense as MoR, "
           "Middle-Cycle N_r=2 (one shared block twice), expert-choice capacities (1, 1/2)",
           repro_mor, baseline="repro-rope-dense"),
    Preset("repro-mor-token", "CPU-scale family: repro-mor with token-choice routing",
           lambda: repro_mor("token"), baseline="repro-rope-dense"),
)
