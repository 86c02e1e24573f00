"""Dense multi-head attention (the SwitchHead paper's baselines) and the positional attention glue
that SwitchHead and MoA share.

Shape legend
    B batch    T query (destination) tokens    S source tokens (keys/values; memory + current)
    D d_model  H heads    C d_head    Hk key/value heads (H, or 1 for MoA)

Positional variants (SwitchHead spec §2):
    "xl"    Transformer-XL relative positions: logits = scale · ((q + u)·k + (q + v)·P(p_i - p_j)),
            P the projection of sinusoidal distance embeddings; the dense baseline learns u, v
            ([H, C]) and the scalar scale (initialised to 1/sqrt(C)).
    "rope"  rotary embeddings on the first half of each head's channels, base 10000.
    "none"  no positional information.

Deviation from the authors' dense XL module: it also holds an unused scalar ``s_bias``, which is
why its 47M model counts one parameter per layer more than ``param_count`` (16 in 47,260,136).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moeify.layers.common import Aux, check_positive, init_scale, project_by_input
from moeify.layers.kv_cache import KVCache
from moeify.ops.attention import ATTENTION_IMPLS, attend, build_mask
from moeify.ops.positional import (
    apply_rope,
    default_positions,
    rope_dims,
    xl_logits_at,
    xl_logits_contiguous,
    xl_position_table,
)
from moeify.ops.xl_attention import xl_attention

POSITIONAL = ("xl", "rope", "none")


# ----------------------------------------------------------------------------------------------
# Validation shared by the attention configs (the generic checks live in moeify.layers.common).


def check_attention_common(cfg) -> None:
    """Checks every attention config shares: sizes, positional variant, dropout, core impl."""
    check_positive(cfg, "d_model", "d_head", "n_layers")
    if cfg.pos not in POSITIONAL:
        raise ValueError(f"{type(cfg).__name__}.pos must be one of {', '.join(POSITIONAL)}, "
                         f"got {cfg.pos!r}")
    if not 0.0 <= cfg.attn_dropout < 1.0:
        raise ValueError(f"{type(cfg).__name__}.attn_dropout must lie in [0, 1), "
                         f"got {cfg.attn_dropout}")
    if cfg.attn_impl not in ATTENTION_IMPLS:
        raise ValueError(f"{type(cfg).__name__}.attn_impl must be one of "
                         f"{', '.join(ATTENTION_IMPLS)}, got {cfg.attn_impl!r}")
    if not 0.0 <= cfg.rope_fraction <= 1.0 or cfg.rope_base <= 0:
        raise ValueError(f"{type(cfg).__name__}: rope_fraction must lie in [0, 1] and rope_base "
                         f"be positive, got {cfg.rope_fraction} and {cfg.rope_base}")


def check_inputs(q_BTD: torch.Tensor, kv_BSD: torch.Tensor | None, d_model: int) -> None:
    if q_BTD.dim() != 3 or q_BTD.shape[-1] != d_model:
        raise ValueError(f"queries must be [B, T, d_model={d_model}], got {tuple(q_BTD.shape)}")
    if kv_BSD is not None and (kv_BSD.dim() != 3 or kv_BSD.shape[-1] != d_model
                               or kv_BSD.shape[0] != q_BTD.shape[0]):
        raise ValueError(f"kv must be [B={q_BTD.shape[0]}, S, d_model={d_model}], "
                         f"got {tuple(kv_BSD.shape)}")


def _check_tokens(name: str, t: torch.Tensor | None, B: int, n: int) -> None:
    if t is not None and tuple(t.shape) != (B, n):
        raise ValueError(f"{name} must be [B, {'T' if name == 'pos_q' else 'S_new'}] = [{B}, {n}], "
                         f"got {tuple(t.shape)}")


# ----------------------------------------------------------------------------------------------
# The glue every attention layer runs between its projections and its output projection.


def positional_attention(
    q_BHTC: torch.Tensor,
    k_BHSC: torch.Tensor,
    v_BHSC: torch.Tensor,
    *,
    pos: str,
    causal: bool,
    scale: float | torch.Tensor,
    self_attention: bool,
    cache: KVCache | None = None,
    pos_q: torch.Tensor | None = None,
    pos_k: torch.Tensor | None = None,
    valid_k: torch.Tensor | None = None,
    rope_n: int = 0,
    rope_base: float = 10000.0,
    w_pos_DHC: torch.Tensor | None = None,
    content_bias_HC: torch.Tensor | None = None,
    pos_bias_HC: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    impl: str = "auto",
) -> torch.Tensor:
    """Positions, cache, mask and the attention core: [B, H, T, C].

    New source tokens get the interface's positions (explicit ``pos_k``, else after the cached
    ones); queries likewise (explicit ``pos_q``, else the last T source positions). In
    self-attention a single given position tensor serves both sides. The contiguous fast paths
    (SDPA's causal mask, the XL diagonal shift) apply only when nothing is cached and no position
    is given; otherwise masks and XL logits are computed from the actual positions. On the
    contiguous XL path without dropout the core is the fused Function of
    moeify.ops.xl_attention; ``impl="reference"`` keeps the explicit logits + softmax.
    """
    B, _, T, _ = q_BHTC.shape
    S_new = k_BHSC.shape[-2]
    if self_attention:
        pos_q, pos_k = (pos_q if pos_q is not None else pos_k,
                        pos_k if pos_k is not None else pos_q)
    _check_tokens("pos_q", pos_q, B, T)
    _check_tokens("pos_k", pos_k, B, S_new)
    _check_tokens("valid_k", valid_k, B, S_new)
    past = 0 if cache is None else cache.length
    explicit = pos_q is not None or pos_k is not None or past > 0
    dq_BT, dk_BS = default_positions(B, T, S_new, past, q_BHTC.device)
    pq_BT = dq_BT if pos_q is None else pos_q.to(torch.int64)
    pk_BS = dk_BS if pos_k is None else pos_k.to(torch.int64)

    if pos == "rope":
        q_BHTC = apply_rope(q_BHTC, pq_BT, n_rot=rope_n, base=rope_base)
        k_BHSC = apply_rope(k_BHSC, pk_BS, n_rot=rope_n, base=rope_base)
    valid = valid_k
    if cache is not None:
        k_BHSC, v_BHSC, pk_BS, valid = cache.append(k_BHSC, v_BHSC, pk_BS, valid_k)
    S = k_BHSC.shape[-2]
    mask = build_mask(T, S, causal=causal, device=q_BHTC.device,
                      pos_q_BT=pq_BT if explicit else None, pos_k_BS=pk_BS if explicit else None,
                      valid_k_BS=valid)

    bias = None
    if pos == "xl":
        qp = q_BHTC if pos_bias_HC is None else q_BHTC + pos_bias_HC[:, None].to(q_BHTC.dtype)
        # The position logits are linear in the query: scale the [B, H, T, C] query rather than
        # the [B, H, T, S] logits.
        qp = qp * scale
        if not explicit and impl == "auto" and dropout_p == 0.0:
            # Fused core (ops/xl_attention.py): the shift as a view, no expanded table.
            qc = qp if content_bias_HC is None and pos_bias_HC is None else (
                q_BHTC if content_bias_HC is None
                else q_BHTC + content_bias_HC[:, None].to(q_BHTC.dtype)) * scale
            p_HRC = xl_position_table(w_pos_DHC, S, T, causal=causal, dtype=qp.dtype)
            out = xl_attention(qc, qp, k_BHSC, v_BHSC, p_HRC, allowed_BTS=mask.allowed_BTS,
                               causal_square=mask.causal_square)
            if mask.nonempty_BT is not None:
                out = out * mask.nonempty_BT[:, None, :, None].to(out.dtype)
            return out
        if explicit:
            bias = xl_logits_at(qp, w_pos_DHC, pq_BT, pk_BS)
        else:
            bias = xl_logits_contiguous(qp, w_pos_DHC, S, causal=causal)
        if content_bias_HC is not None:
            q_BHTC = q_BHTC + content_bias_HC[:, None].to(q_BHTC.dtype)
    return attend(q_BHTC, k_BHSC, v_BHSC, mask, scale=scale, bias_BHTS=bias,
                  dropout_p=dropout_p, impl=impl)



def attention_probs(q_BHTC: torch.Tensor, k_BHSC: torch.Tensor, **kwargs) -> torch.Tensor:
    """The attention probabilities [B, H, T, S] that ``positional_attention`` weights the values
    with, for analysis: the same call applied to identity values (probs @ I = probs), so masks,
    positions and the core are exactly the forward pass's. Takes ``positional_attention``'s
    keyword arguments except ``cache`` and ``dropout_p``. The core runs its reference path
    (explicit softmax): identity values are S wide rather than d_head, which fused cores need
    not support, and every core computes the same probabilities (tests/test_attention_*)."""
    B, Hk, S, _ = k_BHSC.shape
    eye_BHSS = torch.eye(S, dtype=q_BHTC.dtype, device=q_BHTC.device).expand(B, Hk, S, S)
    kwargs["impl"] = "reference"
    return positional_attention(q_BHTC, k_BHSC, eye_BHSS, cache=None, dropout_p=0.0, **kwargs)

# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DenseAttentionConfig:
    """Multi-head attention with H heads of width d_head, no biases (the paper's baselines).

    n_layers: model depth L, for the init std sqrt(2 / (L · fan_in)) (spec §3, dense baseline).
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
        if c.pos == "xl":
            self.w_pos = nn.Parameter(torch.empty(D, hc))
            self.bias_u = nn.Parameter(torch.zeros(c.n_heads, c.d_head))
            self.bias_v = nn.Parameter(torch.zeros(c.n_heads, c.d_head))
            self.scale = nn.Parameter(torch.tensor(1.0 / math.sqrt(c.d_head)))
        self.rope_n = rope_dims(c.d_head, c.rope_fraction)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every projection trunc-normal (±2 std) with std sqrt(2 / (L · fan_in)) (spec §3)."""
        s = init_scale(self.config.n_layers)
        for w in (self.w_q, self.w_k, self.w_v, self.w_o) + (
                (self.w_pos,) if self.config.pos == "xl" else ()):
            std = s / math.sqrt(w.shape[0])
            nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)

    def new_cache(self) -> KVCache:
        return KVCache()

    def param_count(self) -> int:
        return self.config.param_count()

    def forward(self, q_BTD, kv_BSD=None, *, causal=True, cache=None, pos_q=None, pos_k=None,
                valid_k=None):
        """docs/interfaces.md; the returned Aux is empty (nothing is routed)."""
        c = self.config
        check_inputs(q_BTD, kv_BSD, c.d_model)
        src_BSD = q_BTD if kv_BSD is None else kv_BSD
        B, T, _ = q_BTD.shape
        S = src_BSD.shape[1]
        H, C = c.n_heads, c.d_head
        # Q, K and V in one matmul in self-attention, K and V over [memory ; x]; with RoPE the
        # value keeps its own (project_by_input).
        proj = project_by_input([("q", q_BTD, self.w_q), ("k", src_BSD, self.w_k)]
                                + ([] if c.pos == "rope" else [("v", src_BSD, self.w_v)]))
        q, k = proj["q"], proj["k"]
        v = proj["v"] if "v" in proj else src_BSD @ self.w_v
        q = q.view(B, T, H, C).transpose(1, 2)
        k = k.view(B, S, H, C).transpose(1, 2)
        v = v.view(B, S, H, C).transpose(1, 2)
        xl = c.pos == "xl"
        o_BHTC = positional_attention(
            q, k, v, pos=c.pos, causal=causal, self_attention=kv_BSD is None, cache=cache,
            pos_q=pos_q, pos_k=pos_k, valid_k=valid_k,
            scale=self.scale if xl else 1.0 / math.sqrt(C),
            rope_n=self.rope_n, rope_base=c.rope_base,
            w_pos_DHC=self.w_pos.view(c.d_model, H, C) if xl else None,
            content_bias_HC=self.bias_u if xl else None,
            pos_bias_HC=self.bias_v if xl else None,
            dropout_p=c.attn_dropout if self.training else 0.0, impl=c.attn_impl)
        y_BTD = o_BHTC.transpose(1, 2).reshape(B, T, H * C) @ self.w_o
        return y_BTD, Aux()

    @torch.no_grad()
    def inspect(self, q_BTD, kv_BSD=None, *, causal=True, pos_q=None, pos_k=None, valid_k=None):
        """For analysis: ``probs_BHTS``, the attention probabilities of the forward pass (no
        cache, no dropout)."""
        c = self.config
        check_inputs(q_BTD, kv_BSD, c.d_model)
        src_BSD = q_BTD if kv_BSD is None else kv_BSD
        B, T, _ = q_BTD.shape
        H, C = c.n_heads, c.d_head
        q = (q_BTD @ self.w_q).view(B, T, H, C).transpose(1, 2)
        k = (src_BSD @ self.w_k).view(B, src_BSD.shape[1], H, C).transpose(1, 2)
        xl = c.pos == "xl"
        probs = attention_probs(
            q, k, pos=c.pos, causal=causal, self_attention=kv_BSD is None, pos_q=pos_q,
            pos_k=pos_k, valid_k=valid_k, scale=self.scale if xl else 1.0 / math.sqrt(C),
            rope_n=self.rope_n, rope_base=c.rope_base,
            w_pos_DHC=self.w_pos.view(c.d_model, H, C) if xl else None,
            content_bias_HC=self.bias_u if xl else None, pos_bias_HC=self.bias_v if xl else None,
            impl=c.attn_impl)
        return {"probs_BHTS": probs}
