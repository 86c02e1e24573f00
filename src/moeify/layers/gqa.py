"""Grouped-query attention with optional biases: the attention of GPT-2, Llama, Mistral and Qwen2.

Shape legend
    B batch    T query tokens    S source tokens (cached + new)    D d_model
    H query heads    Hk key/value heads (H: multi-head; 1: multi-query; else grouped)
    C d_head

    q = W_q x (+ b_q),  k = W_k x (+ b_k),  v = W_v x (+ b_v)          [B, H|Hk, ·, C]
    o = W_o · concat_h softmax(q_h k_g(h)ᵀ / sqrt(C), causal) v_g(h) (+ b_o)

Query head h reads key/value head g(h) = h // (H / Hk) (Ainslie et al. 2023, GQA §2: the query
heads are split into Hk consecutive groups), the grouping of Hugging Face's ``repeat_kv`` and of
SDPA's ``enable_gqa``. Positions: "rope" rotates ``rope_fraction`` of each head's channels with
``rope_base`` in moeify's rotate-half convention (channel i pairs with i + n/2), which is the
convention of Hugging Face's Llama code, so its checkpoints need no channel permutation;
"absolute" leaves positions to the model's learned embedding (ModelConfig.max_positions, GPT-2),
so inside the layer it is "none", no positional information. ``rope_scaling`` (a
moeify.layers.attention_core.RopeScaling: linear, dynamic NTK, YaRN, Llama 3.1) rescales the RoPE
frequencies of long-context checkpoints as transformers' ``rope_type`` of that name does.

Query/key normalisation (``qk_norm``, before RoPE), as the MoE families moeify imports define it:
"head" is an RMSNorm over each head's C channels, one weight [C] shared by the heads (Qwen3,
Qwen3-MoE); "full" an RMSNorm over the whole projection, q over H·C and k over Hk·C channels
(OLMoE, OLMo 2); "none" (the default) is the Llama family's plain projection.

Positions, masks, the KV cache (keys after RoPE, Hk heads), dropout and the kernel are the
attention core's (moeify.layers.attention_core), so cached decoding, padding and Mixture-of-Depths
positions behave as in every other moeify attention; the core repeats the key/value heads over
their query groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeify.layers.attention import check_inputs, core_config, head_projection_params
from moeify.layers.attention_core import (AttentionCore, RopeScaling, check_core_fields,
                                          check_kv_heads)
from moeify.layers.common import (Aux, check_positive, init_scale,
                                  trunc_normal_exact_std_)
from moeify.layers.kv_cache import KVCacheAttention
from moeify.layers.norm import RMSNorm

GQA_POSITIONAL = ("rope", "none", "absolute")
QK_NORMS = ("none", "head", "full")


@dataclass(frozen=True, kw_only=True)
class GroupedQueryAttentionConfig:
    """n_kv_heads: key/value heads Hk (must divide n_heads); qkv_bias / out_bias: biases of the
    Q, K, V and of the output projection; rope_fraction 1.0 = the full head width (Llama);
    qk_norm: "none", "head" or "full" RMSNorm of queries and keys (module docstring), with
    ``qk_norm_eps``."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    pos: str = "rope"
    rope_base: float = 10000.0
    rope_fraction: float = 1.0
    qkv_bias: bool = False
    out_bias: bool = False
    n_layers: int = 1
    attn_dropout: float = 0.0
    attn_impl: str = "auto"
    qk_norm: str = "none"
    qk_norm_eps: float = 1e-6
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        check_positive(self, "d_model", "n_heads", "n_kv_heads", "d_head", "n_layers")
        check_core_fields(self, GQA_POSITIONAL)
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"GroupedQueryAttentionConfig.qk_norm must be one of "
                             f"{', '.join(QK_NORMS)}, got {self.qk_norm!r}")
        if not self.qk_norm_eps > 0:
            raise ValueError(f"GroupedQueryAttentionConfig.qk_norm_eps must be positive, "
                             f"got {self.qk_norm_eps}")
        if self.rope_scaling is not None and self.pos != "rope":
            raise ValueError("GroupedQueryAttentionConfig.rope_scaling needs pos='rope'")
        check_kv_heads(self)

    def param_count(self) -> int:
        C = self.d_head
        n = head_projection_params(self.d_model, self.n_heads, self.n_kv_heads, C,
                                   qkv_bias=self.qkv_bias, out_bias=self.out_bias)
        if self.qk_norm == "head":
            n += 2 * C
        elif self.qk_norm == "full":
            n += (self.n_heads + self.n_kv_heads) * C
        return n

    def build(self) -> "GroupedQueryAttention":
        return GroupedQueryAttention(self)


class GroupedQueryAttention(KVCacheAttention):
    def __init__(self, config: GroupedQueryAttentionConfig):
        super().__init__()
        self.config = c = config
        D, H, Hk, C = c.d_model, c.n_heads, c.n_kv_heads, c.d_head
        self.w_q = nn.Linear(D, H * C, bias=c.qkv_bias)
        self.w_k = nn.Linear(D, Hk * C, bias=c.qkv_bias)
        self.w_v = nn.Linear(D, Hk * C, bias=c.qkv_bias)
        self.w_o = nn.Linear(H * C, D, bias=c.out_bias)
        if c.qk_norm != "none":
            full = c.qk_norm == "full"
            self.q_norm = RMSNorm(H * C if full else C, eps=c.qk_norm_eps)
            self.k_norm = RMSNorm(Hk * C if full else C, eps=c.qk_norm_eps)
        self.core = AttentionCore(core_config(c, n_heads=H, n_kv_heads=Hk))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As the dense baseline: trunc-normal rescaled to std sqrt(2 / (L · fan_in))
        (SwitchHead appendix), biases zero."""
        s = init_scale(self.config.n_layers)
        for lin in (self.w_q, self.w_k, self.w_v, self.w_o):
            trunc_normal_exact_std_(lin.weight, s / lin.in_features ** 0.5)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.core.reset_parameters()

    def _qkv(self, q_BTD, kv_BSD):
        """Q [B, H, T, C], K and V [B, Hk, S, C]: the projections of forward and inspect."""
        c = self.config
        check_inputs(q_BTD, kv_BSD, c.d_model)
        src_BSD = q_BTD if kv_BSD is None else kv_BSD
        B, T, _ = q_BTD.shape
        S = src_BSD.shape[1]
        H, Hk, C = c.n_heads, c.n_kv_heads, c.d_head
        q, k = self.w_q(q_BTD), self.w_k(src_BSD)
        if c.qk_norm == "full":  # over the whole projection, before the split into heads
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(B, T, H, C), k.view(B, S, Hk, C)
        if c.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return (q.transpose(1, 2), k.transpose(1, 2),
                self.w_v(src_BSD).view(B, S, Hk, C).transpose(1, 2))

    def forward(self, q_BTD, kv_BSD=None, *, causal=True, cache=None, pos_q=None, pos_k=None,
                valid_k=None):
        """docs/interfaces.md; the returned Aux is empty (nothing is routed)."""
        q, k, v = self._qkv(q_BTD, kv_BSD)
        o_BHTC = self.core(q, k, v, causal=causal, self_attention=kv_BSD is None, cache=cache,
                           pos_q=pos_q, pos_k=pos_k, valid_k=valid_k)
        B, H, T, C = o_BHTC.shape
        return self.w_o(o_BHTC.transpose(1, 2).reshape(B, T, H * C)), Aux()

    @torch.no_grad()
    def inspect(self, q_BTD, kv_BSD=None, *, causal=True, pos_q=None, pos_k=None, valid_k=None):
        """For analysis: ``probs_BHTS``, the attention probabilities of the forward pass (no
        cache, no dropout), one map per query head."""
        q, k, _ = self._qkv(q_BTD, kv_BSD)
        return {"probs_BHTS": self.core.probs(q, k, causal=causal, self_attention=kv_BSD is None,
                                              pos_q=pos_q, pos_k=pos_k, valid_k=valid_k)}


__all__ = ["GQA_POSITIONAL", "GroupedQueryAttentionConfig", "GroupedQueryAttention"]
