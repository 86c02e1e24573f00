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
from moeify.layers.common import Aux, check_positive, init_scale, trunc_normal_exact_std_
from moeify.layers.kv_cache import KVCacheAttention
from moeify.layers.projection import project_by_input

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


def destination_validity(valid_k: torch.Tensor | None, kv_BSD: torch.Tensor | None, T: int,
                         causal: bool) -> torch.Tensor | None:
    """Which of an attention layer's T queries are real tokens, [B, T], from the validity of its
    new keys ``valid_k`` [B, S_new]: the keys themselves in self-attention; their last T with
    causal attention over [memory ; x] (the queries are the newest keys, as in
    TransformerBlock); unknown (None) in cross-attention or without ``valid_k``."""
    if valid_k is None:
        return None
    if kv_BSD is None:
        return valid_k
    if causal and valid_k.shape[1] >= T:
        return valid_k[:, -T:]
    return None


def head_projection_params(d_model: int, n_heads: int, n_kv_heads: int, d_head: int, *,
                           qkv_bias: bool = False, out_bias: bool = False) -> int:
    """Q and O: d·H·d_h each; K and V: d·Hk·d_h each; the biases (H + 2·Hk)·d_h and d."""
    D, H, Hk, C = d_model, n_heads, n_kv_heads, d_head
    return (2 * D * H * C + 2 * D * Hk * C + ((H + 2 * Hk) * C if qkv_bias else 0)
            + (D if out_bias else 0))


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
        n = head_projection_params(self.d_model, self.n_heads, self.n_heads, self.d_head)
        if self.pos == "xl":
            n += self.d_model * hc + 2 * hc + 1
        return n

    def build(self) -> "DenseAttention":
        return DenseAttention(self)


class HeadAttention(KVCacheAttention):
    """What dense multi-head attention and MoH (moeify.layers.moh) share: ``w_q`` [D, H·C],
    ``w_k`` and ``w_v`` [D, Hk·C], ``w_o`` [H·C, D]; with ``qkv_bias`` ``bias_q`` [H·C],
    ``bias_k`` and ``bias_v`` [Hk·C], with ``out_bias`` ``bias_o`` [D]; then the ``extra``
    Parameters a subclass asks for (MoH's routers; it initialises them); then the attention
    core, whose XL u, v and scale are learned (the dense baseline). Registered in that order,
    the state dict's and the optimizer's. ``config``: d_model, n_heads, d_head, n_layers and the
    core's fields (pos, rope, dropout, kernel)."""

    BIASES = ("bias_q", "bias_k", "bias_v", "bias_o")

    def __init__(self, config, *, n_kv_heads: int, qkv_bias: bool = False,
                 out_bias: bool = False, extra: dict[str, tuple[int, ...]] | None = None):
        super().__init__()
        self.config = c = config
        D, H, Hk, C = c.d_model, c.n_heads, n_kv_heads, c.d_head
        self.kv_heads, self.qkv_bias = Hk, qkv_bias
        shapes = {"w_q": (D, H * C), "w_k": (D, Hk * C), "w_v": (D, Hk * C), "w_o": (H * C, D)}
        if qkv_bias:
            shapes.update(bias_q=(H * C,), bias_k=(Hk * C,), bias_v=(Hk * C,))
        if out_bias:
            shapes["bias_o"] = (D,)
        for name, shape in {**shapes, **(extra or {})}.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))
        self.core = AttentionCore(core_config(c, n_heads=H, n_kv_heads=Hk, xl_biases=True))
        self._weight_memo: dict = {}  # fused projection weights (project_by_input)

    @torch.no_grad()
    def reset_heads(self) -> None:
        """Every projection (and XL's position projection) trunc-normal (±2 std) with std
        sqrt(2 / (L · fan_in)) (SwitchHead appendix), rescaled to exactly that std as the
        authors' code does (trunc_normal_exact_std_); the biases zero."""
        s = init_scale(self.config.n_layers)
        for w in (self.w_q, self.w_k, self.w_v, self.w_o) + (
                (self.core.w_pos,) if self.config.pos == "xl" else ()):
            trunc_normal_exact_std_(w, s / math.sqrt(w.shape[0]))
        for name in self.BIASES:
            if hasattr(self, name):
                getattr(self, name).zero_()

    def _qkv(self, q_BTD, kv_BSD):
        """Q [B, H, T, C], K and V [B, Hk, S, C]: in one matmul in self-attention, K and V over
        [memory ; x]; with RoPE the value keeps its own (project_by_input)."""
        c = self.config
        src_BSD = q_BTD if kv_BSD is None else kv_BSD
        B, T, _ = q_BTD.shape
        S = src_BSD.shape[1]
        H, Hk, C = c.n_heads, self.kv_heads, c.d_head
        proj = project_by_input([("q", q_BTD, self.w_q), ("k", src_BSD, self.w_k)]
                                + ([] if c.pos == "rope" else [("v", src_BSD, self.w_v)]),
                                self._weight_memo)
        q, k = proj["q"], proj["k"]
        v = proj["v"] if "v" in proj else src_BSD @ self.w_v
        if self.qkv_bias:
            q, k, v = q + self.bias_q, k + self.bias_k, v + self.bias_v
        return (q.view(B, T, H, C).transpose(1, 2), k.view(B, S, Hk, C).transpose(1, 2),
                v.view(B, S, Hk, C).transpose(1, 2))


class DenseAttention(HeadAttention):
    def __init__(self, config: DenseAttentionConfig):
        super().__init__(config, n_kv_heads=config.n_heads)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.reset_heads()
        self.core.reset_parameters()

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
