"""Dense multi-head attention (the SwitchHead paper's baselines) and the checks every attention
config shares.

Shape legend
    B batch    T query (destination) tokens    S source tokens (keys/values; memory + current)
    D d_model  H heads    C d_head

Positions, masks, cache and dropout live in the attention core (moeify.layers.attention_core);
with XL positions the dense baseline's core learns the u, v biases and the logit scale.

Deviation from the authors' dense XL module: it also holds an unused scalar ``s_bias``, which is
why its 47M model counts one parameter per layer more than ``param_count`` (16 in 47,260,136).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moeify.layers.attention_core import AttentionCore, AttentionCoreConfig, check_core_fields
from moeify.layers.common import (
    Aux,
    check_positive,
    init_scale,
    project_by_input,
    trunc_normal_exact_std_,
)
from moeify.layers.kv_cache import KVCache

# The paper layers' positional variants (the core also knows "absolute", which the model adds).
POSITIONAL = ("xl", "rope", "none")


def check_attention_common(cfg) -> None:
    """Checks every attention config shares: sizes, positional variant, dropout, core impl."""
    check_positive(cfg, "d_model", "d_head", "n_layers")
    check_core_fields(cfg, POSITIONAL)


def check_inputs(q_BTD: torch.Tensor, kv_BSD: torch.Tensor | None, d_model: int) -> None:
    if q_BTD.dim() != 3 or q_BTD.shape[-1] != d_model:
        raise ValueError(f"queries must be [B, T, d_model={d_model}], got {tuple(q_BTD.shape)}")
    if kv_BSD is not None and (kv_BSD.dim() != 3 or kv_BSD.shape[-1] != d_model
                               or kv_BSD.shape[0] != q_BTD.shape[0]):
        raise ValueError(f"kv must be [B={q_BTD.shape[0]}, S, d_model={d_model}], "
                         f"got {tuple(kv_BSD.shape)}")


def core_config(cfg, *, n_heads: int, n_kv_heads: int | None = None, xl_heads: int | None = None,
                xl_biases: bool = False) -> AttentionCoreConfig:
    """The AttentionCoreConfig of an attention layer config (its pos / rope / dropout fields)."""
    return AttentionCoreConfig(d_model=cfg.d_model, n_heads=n_heads, d_head=cfg.d_head,
                               n_kv_heads=n_kv_heads, pos=cfg.pos, xl_heads=xl_heads,
                               xl_biases=xl_biases, rope_fraction=cfg.rope_fraction,
                               rope_base=cfg.rope_base,
                               rope_scaling=getattr(cfg, "rope_scaling", None),
                               attn_dropout=cfg.attn_dropout,
                               attn_impl=cfg.attn_impl)


@dataclass(frozen=True, kw_only=True)
class DenseAttentionConfig:
    """Multi-head attention with H heads of width d_head, no biases (the paper's baselines).

    n_layers: model depth L, for the init std sqrt(2 / (L · fan_in)) (SwitchHead appendix, dense
    baseline).
    attn_dropout: dropout on attention probabilities (0 in every paper run).
    attn_impl: "auto" (SDPA where no XL term) or "reference" (explicit softmax).
    """

    d_model: int
    n_heads: int
    d_head: int
    pos: str = "xl"
    n_layers: int = 1
    attn_dropout: float = 0.0
    rope_fraction: float = 0.5
    rope_base: float = 10000.0
    attn_impl: str = "auto"

    def __post_init__(self) -> None:
        check_positive(self, "n_heads")
        check_attention_common(self)

    def param_count(self) -> int:
        """Q, K, V: d -> H·d_h; O: H·d_h -> d; XL adds the position projection d -> H·d_h, the
        u and v biases [H, d_h] and the scalar scale."""
        hc = self.n_heads * self.d_head
        n = 4 * self.d_model * hc
        if self.pos == "xl":
            n += self.d_model * hc + 2 * hc + 1
        return n

    def build(self) -> "DenseAttention":
        return DenseAttention(self)


class DenseAttention(nn.Module):
    def __init__(self, config: DenseAttentionConfig):
        super().__init__()
        self.config = c = config
        D, hc = c.d_model, c.n_heads * c.d_head
        self.w_q = nn.Parameter(torch.empty(D, hc))
        self.w_k = nn.Parameter(torch.empty(D, hc))
        self.w_v = nn.Parameter(torch.empty(D, hc))
        self.w_o = nn.Parameter(torch.empty(hc, D))
        self.core = AttentionCore(core_config(c, n_heads=c.n_heads, xl_biases=True))
        self._weight_memo: dict = {}  # fused projection weights (project_by_input)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every projection trunc-normal (±2 std) with std sqrt(2 / (L · fan_in)) (SwitchHead
        appendix),
        rescaled to exactly that std as the authors' code does (trunc_normal_exact_std_)."""
        s = init_scale(self.config.n_layers)
        for w in (self.w_q, self.w_k, self.w_v, self.w_o) + (
                (self.core.w_pos,) if self.config.pos == "xl" else ()):
            trunc_normal_exact_std_(w, s / math.sqrt(w.shape[0]))
        self.core.reset_parameters()

    def new_cache(self) -> KVCache:
        return KVCache()

    def param_count(self) -> int:
        return self.config.param_count()

    def _qkv(self, q_BTD, kv_BSD):
        """Q, K, V as [B, H, N, C]: in one matmul in self-attention, K and V over [memory ; x];
        with RoPE the value keeps its own (project_by_input)."""
        c = self.config
        src_BSD = q_BTD if kv_BSD is None else kv_BSD
        B, T, _ = q_BTD.shape
        S = src_BSD.shape[1]
        H, C = c.n_heads, c.d_head
        proj = project_by_input([("q", q_BTD, self.w_q), ("k", src_BSD, self.w_k)]
                                + ([] if c.pos == "rope" else [("v", src_BSD, self.w_v)]),
                                self._weight_memo)
        v = proj["v"] if "v" in proj else src_BSD @ self.w_v
        return (proj["q"].view(B, T, H, C).transpose(1, 2),
                proj["k"].view(B, S, H, C).transpose(1, 2), v.view(B, S, H, C).transpose(1, 2))

    def forward(self, q_BTD, kv_BSD=None, *, causal=True, cache=None, pos_q=None, pos_k=None,
                valid_k=None):
        """docs/interfaces.md; the returned Aux is empty (nothing is routed)."""
        check_inputs(q_BTD, kv_BSD, self.config.d_model)
        q, k, v = self._qkv(q_BTD, kv_BSD)
        o_BHTC = self.core(q, k, v, causal=causal, self_attention=kv_BSD is None, cache=cache,
                           pos_q=pos_q, pos_k=pos_k, valid_k=valid_k)
        B, H, T, C = o_BHTC.shape
        return o_BHTC.transpose(1, 2).reshape(B, T, H * C) @ self.w_o, Aux()

    @torch.no_grad()
    def inspect(self, q_BTD, kv_BSD=None, *, causal=True, pos_q=None, pos_k=None, valid_k=None):
        """For analysis: ``probs_BHTS``, the attention probabilities of the forward pass (no
        cache, no dropout)."""
        check_inputs(q_BTD, kv_BSD, self.config.d_model)
        q, k, _ = self._qkv(q_BTD, kv_BSD)
        return {"probs_BHTS": self.core.probs(q, k, causal=causal, self_attention=kv_BSD is None,
                                              pos_q=pos_q, pos_k=pos_k, valid_k=valid_k)}
