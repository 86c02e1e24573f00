"""The attention core every attention layer runs between its projections and its output
projection: positions, key/value cache, masks, dropout and the softmax(q kᵀ) v of
moeify.ops.attention, behind one narrow call.

Shape legend
    B batch    T query (destination) tokens    S source tokens (keys/values; memory + current)
    D d_model  H query heads    Hk key/value heads (dividing H)    C d_head

Positional variants (SwitchHead appendix):
    "xl"        Transformer-XL relative positions: logits = scale · ((q + u)·k + (q + v)·P(p_i -
                p_j)), P the projection of sinusoidal distance embeddings ``w_pos`` (d_model ->
                ``xl_heads`` x d_head; one head broadcasts over the query heads, as MoA). With
                ``xl_biases`` the core learns u, v ([H, C]) and the scalar scale (initialised to
                1/sqrt(C)), as the dense baseline; otherwise u = v = 0 and scale = 1/sqrt(C).
    "rope"      rotary embeddings on the first ``rope_fraction`` of each head's channels
                (0.5 in the papers; 1.0 is the usual full rotation), base ``rope_base``.
    "none"      no positional information.
    "absolute"  learned absolute positions added to the embeddings by the model: the core itself
                does nothing positional (same computation as "none").

The layer that owns a core initialises its ``w_pos`` (each paper has its own recipe); the core
initialises only u, v (zero) and the scale.

Grouped-query attention: keys and values may carry Hk heads, Hk dividing H; query head h reads
key/value head h // (H / Hk). The KV cache stores the Hk heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moeify.layers.common import load_scalars_as_vectors
from moeify.layers.kv_cache import KVCache
from moeify.ops.attention import ATTENTION_IMPLS, attend, build_mask
from moeify.ops.positional import (
    ROPE_TYPES,
    XLPositionTableCache,
    apply_rope,
    default_positions,
    rope_dims,
    xl_logits_at,
    xl_logits_contiguous,
    xl_position_table,
)
from moeify.ops.xl_attention import xl_attention

POSITIONAL = ("xl", "rope", "none", "absolute")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How the RoPE frequencies of a long-context checkpoint are rescaled
    (moeify.ops.positional.scaled_rope_inv_freq), as transformers' ``rope_type`` of that name.

    kind               "linear"  position interpolation: every frequency / ``factor``
                                 (Chen et al. 2023, arXiv:2306.15595, §2.2)
                       "dynamic" dynamic NTK: base · (factor · S / original - (factor - 1))
                                 ^ (n / (n - 2)) once S = the call's largest position + 1
                                 exceeds ``original``
                                 (deviation: transformers keeps the largest S of earlier calls
                                 until a call fits the original context again; moeify reads each
                                 call's own S, so the two agree on every single forward and on
                                 decoding, whose S only grows)
                       "yarn"    YaRN (Peng et al. 2023, arXiv:2309.00071): per-frequency ramp
                                 between interpolation and extrapolation (Eq. 17-18, corrections
                                 beta_fast / beta_slow) and the attention temperature
                                 0.1 ln(factor) + 1 on cos and sin (Eq. 21-22)
                       "llama3"  Llama 3.1: low frequencies / factor, high ones kept, a linear
                                 blend in wavelength between (low_freq_factor, high_freq_factor)
    original_context   the pretraining context (original_max_position_embeddings)
    attention_factor   YaRN's factor on cos and sin (None: from factor, mscale, mscale_all_dim)
    """

    kind: str
    factor: float
    original_context: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROPE_TYPES[1:]:
            raise ValueError(f"RopeScaling.kind must be one of {', '.join(ROPE_TYPES[1:])}, "
                             f"got {self.kind!r}")
        if not self.factor > 0 or self.original_context < 1:
            raise ValueError(f"RopeScaling needs factor > 0 and original_context >= 1, got "
                             f"{self.factor} and {self.original_context}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("RopeScaling (llama3): high_freq_factor must exceed low_freq_factor")



@dataclass(frozen=True, kw_only=True)
class AttentionCoreConfig:
    """What the core needs to know: head geometry, positions, dropout and the kernel choice.

    n_kv_heads: key/value heads (None: n_heads); must divide n_heads.
    xl_heads: heads of the XL position projection (None: n_heads; 1 broadcasts, as MoA).
    xl_biases: learn the XL u / v biases and the logit scale (the dense baseline).
    attn_impl: "auto" (SDPA, or the fused XL core, where possible) or "reference".
    """

    d_model: int
    n_heads: int
    d_head: int
    n_kv_heads: int | None = None
    pos: str = "xl"
    xl_heads: int | None = None
    xl_biases: bool = False
    rope_fraction: float = 0.5
    rope_base: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attn_dropout: float = 0.0
    attn_impl: str = "auto"

    def __post_init__(self) -> None:
        check_core_fields(self)
        check_kv_heads(self)

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def pos_heads(self) -> int:
        return self.n_heads if self.xl_heads is None else self.xl_heads

    def param_count(self) -> int:
        """XL: the position projection d -> xl_heads·d_h, plus u, v [H, d_h] and the scale with
        ``xl_biases``; nothing otherwise."""
        if self.pos != "xl":
            return 0
        n = self.d_model * self.pos_heads * self.d_head
        if self.xl_biases:
            n += 2 * self.n_heads * self.d_head + 1
        return n


def check_core_fields(cfg, positional: tuple[str, ...] = POSITIONAL) -> None:
    """The checks every attention config shares: positional variant, dropout, core kernel and
    RoPE settings (ValueError naming the config class and the field)."""
    who = type(cfg).__name__
    if cfg.pos not in positional:
        raise ValueError(f"{who}.pos must be one of {', '.join(positional)}, got {cfg.pos!r}")
    if not 0.0 <= cfg.attn_dropout < 1.0:
        raise ValueError(f"{who}.attn_dropout must lie in [0, 1), got {cfg.attn_dropout}")
    if cfg.attn_impl not in ATTENTION_IMPLS:
        raise ValueError(f"{who}.attn_impl must be one of {', '.join(ATTENTION_IMPLS)}, "
                         f"got {cfg.attn_impl!r}")
    if not 0.0 <= cfg.rope_fraction <= 1.0 or cfg.rope_base <= 0:
        raise ValueError(f"{who}: rope_fraction must lie in [0, 1] and rope_base be positive, "
                         f"got {cfg.rope_fraction} and {cfg.rope_base}")


def check_kv_heads(cfg) -> None:
    """``cfg.n_kv_heads`` (None: ``cfg.n_heads``) must be a positive divisor of ``cfg.n_heads``:
    each key/value head serves a group of n_heads / n_kv_heads query heads."""
    kv = cfg.n_heads if cfg.n_kv_heads is None else cfg.n_kv_heads
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or cfg.n_heads % kv:
        raise ValueError(f"{type(cfg).__name__}.n_kv_heads must be a positive divisor of "
                         f"n_heads={cfg.n_heads}, got {cfg.n_kv_heads!r}")


def _check_tokens(name: str, t: torch.Tensor | None, B: int, n: int) -> None:
    if t is not None and tuple(t.shape) != (B, n):
        raise ValueError(f"{name} must be [B, {'T' if name == 'pos_q' else 'S_new'}] = [{B}, {n}], "
                         f"got {tuple(t.shape)}")


class AttentionCore(nn.Module):
    """``core(q_BHTC, k_BHSC, v_BHSC, causal=..., cache=..., pos_q=..., pos_k=..., valid_k=...,
    self_attention=...)`` -> [B, H, T, C]; ``core.probs(q, k, ...)`` the probabilities."""

    def __init__(self, config: AttentionCoreConfig):
        super().__init__()
        self.config = c = config
        if c.pos == "xl":
            self.w_pos = nn.Parameter(torch.empty(c.d_model, c.pos_heads * c.d_head))
            if c.xl_biases:
                self.bias_u = nn.Parameter(torch.zeros(c.n_heads, c.d_head))
                self.bias_v = nn.Parameter(torch.zeros(c.n_heads, c.d_head))
                # [1], not 0-dim: FSDP2 shards dim 0 of every parameter
                self.scale = nn.Parameter(torch.full((1,), 1.0 / math.sqrt(c.d_head)))
                load_scalars_as_vectors(self, "scale")
        self.rope_n = rope_dims(c.d_head, c.rope_fraction) if c.pos == "rope" else 0

    def reset_parameters(self) -> None:
        """u, v zero and the scale 1/sqrt(d_head); ``w_pos`` is the owning layer's to draw."""
        if self.config.pos == "xl" and self.config.xl_biases:
            with torch.no_grad():
                self.bias_u.zero_()
                self.bias_v.zero_()
                self.scale.fill_(1.0 / math.sqrt(self.config.d_head))

    def _scale(self):
        c = self.config
        return self.scale[0] if c.pos == "xl" and c.xl_biases else 1.0 / math.sqrt(c.d_head)

    def forward(self, q_BHTC, k_BHSC, v_BHSC, *, causal: bool = True, self_attention: bool = True,
                cache: KVCache | None = None, pos_q=None, pos_k=None, valid_k=None,
                impl: str | None = None) -> torch.Tensor:
        """Positions, cache, mask and attention: [B, H, T, C].

        New source tokens get the interface's positions (explicit ``pos_k``, else after the
        cached ones); queries likewise (explicit ``pos_q``, else the last T source positions).
        In self-attention a single given position tensor serves both sides. The contiguous fast
        paths (SDPA's causal mask, the XL diagonal shift) apply when no position is given and
        every cached token sits at its default position (``KVCache.contiguous``); otherwise
        masks and XL logits are computed from the actual positions. On the contiguous XL path without dropout the core is the fused Function of
        moeify.ops.xl_attention; ``impl="reference"`` keeps the explicit logits + softmax."""
        c = self.config
        impl = c.attn_impl if impl is None else impl
        dropout_p = c.attn_dropout if self.training else 0.0
        B, _, T, _ = q_BHTC.shape
        S_new = k_BHSC.shape[-2]
        if self_attention:
            pos_q, pos_k = (pos_q if pos_q is not None else pos_k,
                            pos_k if pos_k is not None else pos_q)
        _check_tokens("pos_q", pos_q, B, T)
        _check_tokens("pos_k", pos_k, B, S_new)
        _check_tokens("valid_k", valid_k, B, S_new)
        past = 0 if cache is None else cache.length
        given = pos_q is not None or pos_k is not None
        # Cached tokens at their default positions keep the contiguous case (and its fast
        # paths): query i of T sits at S - T + i, key j at j.
        explicit = given or (past > 0 and not cache.contiguous)
        dq_BT, dk_BS = default_positions(B, T, S_new, past, q_BHTC.device)
        pq_BT = dq_BT if pos_q is None else pos_q.to(torch.int64)
        pk_BS = dk_BS if pos_k is None else pos_k.to(torch.int64)

        if c.pos == "rope":
            q_BHTC = apply_rope(q_BHTC, pq_BT, n_rot=self.rope_n, base=c.rope_base,
                                scaling=c.rope_scaling)
            k_BHSC = apply_rope(k_BHSC, pk_BS, n_rot=self.rope_n, base=c.rope_base,
                                scaling=c.rope_scaling)
        valid = valid_k
        if cache is not None:
            k_BHSC, v_BHSC, pk_BS, valid = cache.append(k_BHSC, v_BHSC, pk_BS, valid_k,
                                                        default_positions=not given)
            if cache.all_valid:  # nothing to mask out: decoding keeps its mask-free fast path
                valid = None
        k_BHSC, v_BHSC = self._expand_groups(k_BHSC, v_BHSC)
        mask = build_mask(T, k_BHSC.shape[-2], causal=causal, device=q_BHTC.device,
                          pos_q_BT=pq_BT if explicit else None,
                          pos_k_BS=pk_BS if explicit else None, valid_k_BS=valid)
        if c.pos == "xl":
            return self._xl(q_BHTC, k_BHSC, v_BHSC, mask, causal, pq_BT, pk_BS, explicit,
                            dropout_p, impl, cache)
        return attend(q_BHTC, k_BHSC, v_BHSC, mask, scale=self._scale(), dropout_p=dropout_p,
                      impl=impl)

    def _expand_groups(self, k, v):
        """Grouped-query attention: repeat each of Hk > 1 key/value heads over its H / Hk query
        heads (one shared head broadcasts in every kernel, so it stays as it is)."""
        c = self.config
        Hk, H = k.shape[1], c.n_heads
        if Hk in (1, H):
            return k, v
        return k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)

    def _position_table(self, w_pos_DHC, S: int, T: int, causal: bool, dtype,
                        cache: KVCache | None) -> torch.Tensor:
        """The projected distance table of the contiguous XL path; while decoding (a cache,
        causal, no gradients) kept in the cache from step to step instead of recomputed."""
        if cache is None or not causal or (torch.is_grad_enabled() and self.w_pos.requires_grad):
            return xl_position_table(w_pos_DHC, S, T, causal=causal, dtype=dtype)
        memo = cache.derived.get("xl_positions")
        if memo is None:
            memo = cache.derived["xl_positions"] = XLPositionTableCache()
        return memo.table(w_pos_DHC, S, dtype)

    def _xl(self, q, k, v, mask, causal, pq_BT, pk_BS, explicit, dropout_p, impl, cache=None):
        c = self.config
        scale = self._scale()
        w_pos_DHC = self.w_pos.view(c.d_model, c.pos_heads, c.d_head)
        u = self.bias_u if c.xl_biases else None
        vb = self.bias_v if c.xl_biases else None
        qp = q if vb is None else q + vb[:, None].to(q.dtype)
        # The position logits are linear in the query: scale the [B, H, T, C] query rather than
        # the [B, H, T, S] logits.
        qp = qp * scale
        S = k.shape[-2]
        if not explicit and impl == "auto" and dropout_p == 0.0 \
                and not torch.compiler.is_compiling():
            # Fused core (ops/xl_attention.py): the shift as a view, no expanded table. Under
            # torch.compile the explicit path below is traced instead (the Function takes the
            # same tensor as two inputs, which the compiler refuses; it fuses the explicit
            # logits itself).
            qc = qp if u is None and vb is None else (
                q if u is None else q + u[:, None].to(q.dtype)) * scale
            p_HRC = self._position_table(w_pos_DHC, S, q.shape[-2], causal, qp.dtype, cache)
            out = xl_attention(qc, qp, k, v, p_HRC, allowed_BTS=mask.allowed_BTS,
                               causal_square=mask.causal_square)
            if mask.nonempty_BT is not None:
                out = out * mask.nonempty_BT[:, None, :, None].to(out.dtype)
            return out
        if explicit:
            bias = xl_logits_at(qp, w_pos_DHC, pq_BT, pk_BS)
        else:
            bias = xl_logits_contiguous(qp, w_pos_DHC, S, causal=causal)
        if u is not None:
            q = q + u[:, None].to(q.dtype)
        return attend(q, k, v, mask, scale=scale, bias_BHTS=bias, dropout_p=dropout_p, impl=impl)

    def probs(self, q_BHTC, k_BHSC, **kwargs) -> torch.Tensor:
        """The attention probabilities [B, H, T, S] that ``forward`` weights the values with, for
        analysis: the same call applied to identity values (probs @ I = probs), so masks,
        positions and the core are exactly the forward pass's. Takes ``forward``'s keyword
        arguments except ``cache``. No dropout; the reference kernel (explicit softmax):
        identity values are S wide rather than d_head, which fused kernels need not support, and
        every kernel computes the same probabilities (tests/layers/test_attention_*)."""
        B, Hk, S, _ = k_BHSC.shape
        eye_BHSS = torch.eye(S, dtype=q_BHTC.dtype, device=q_BHTC.device).expand(B, Hk, S, S)
        was_training = self.training
        self.train(False)
        try:
            return self(q_BHTC, k_BHSC, eye_BHSS, cache=None, impl="reference", **kwargs)
        finally:
            self.train(was_training)
