"""MoA, Mixture of Attention heads (Zhang et al., EMNLP 2022, arXiv 2210.05144).

Shape legend
    B batch     T destination (query) tokens    S source (key/value) tokens, memory included
    D d_model   E experts    K selected experts per token (k, MoA's "heads")    C d_head
    M = B·T routed tokens

One single-head key and value projection (d -> d_h) shared by every expert, computed once; each
expert e owns W_q^e (d -> d_h) and W_o^e (d_h -> d). Per destination token t, with a router
W_g (d -> E, zero-initialised):
    p_t    = softmax(x_t W_g) (float32);  the top-k experts of p_t are t's heads
    head_e = softmax(q_e Kᵀ / sqrt(d_h) + mask [+ XL position term]) V
    y_t    = Σ_{e ∈ topk(t)} p_t,e · head_e[t] W_o^e
The kept gates are not renormalised (as the authors' code; ``renormalize`` is an option).
Auxiliary losses (per layer, padding excluded, present whenever the coefficient is non-zero):
    balance: balance_coef · E · Σ_e norm1(Σ_t p_t)_e · norm1(count_e)
    z:       z_coef · mean_t logsumexp(x_t W_g)²
    cv:      cv_coef · CV²(Σ_t gate_t,e)   (gates scattered to E, 0 outside the top-k)

Slot j of the k selected experts plays the role of head j in the attention core (keys and values
broadcast over the slots), so the core runs on scaled_dot_product_attention for RoPE and no
positions. The XL variant projects the sinusoids to a single shared head (d -> d_h), without u/v
biases and with the fixed 1/sqrt(d_h) scale. The Q and O expert matmuls share one sorted plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moeify.layers.attention import (
    check_attention_common,
    check_inputs,
    core_config,
    destination_validity,
)
from moeify.layers.attention_core import AttentionCore
from moeify.layers.common import (
    Aux,
    accumulate_usage,
    check_expert_impl,
    check_positive,
    init_scale,
    register_usage,
    routing_record,
)
from moeify.layers.kv_cache import KVCacheAttention
from moeify.layers.projection import project_by_input
from moeify.ops.aux_losses import cv_squared, moa_balance_loss, router_entropy, z_loss
from moeify.ops.moe import expert_matmul, make_plan
from moeify.ops.moe.policy import planless
from moeify.ops.routing import selection_logits, softmax_topk


@dataclass(frozen=True, kw_only=True)
class MoAConfig:
    """Mixture of attention heads: E experts, k selected per token (``n_heads`` is k).

    n_layers: model depth L for the init s = sqrt(2 / L) (as SwitchHead, its appendix).
    renormalize: rescale the k kept gates to sum to 1 (off in the authors' code).
    balance_coef, z_coef, cv_coef: auxiliary-loss coefficients (MoA's defaults).
    """

    d_model: int
    d_head: int
    n_experts: int
    k: int
    pos: str = "xl"
    n_layers: int = 1
    renormalize: bool = False
    balance_coef: float = 0.01
    z_coef: float = 0.001
    cv_coef: float = 0.0
    attn_dropout: float = 0.0
    rope_fraction: float = 0.5
    rope_base: float = 10000.0
    attn_impl: str = "auto"
    expert_impl: str = "auto"

    def __post_init__(self) -> None:
        check_positive(self, "n_experts", "k")
        check_attention_common(self)
        if self.k > self.n_experts:
            raise ValueError(f"k={self.k} exceeds n_experts={self.n_experts}; "
                             f"choose k in [1, {self.n_experts}]")
        for name in ("balance_coef", "z_coef", "cv_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"MoAConfig.{name} must be >= 0, got {getattr(self, name)}")
        check_expert_impl(self)

    @property
    def n_heads(self) -> int:
        """Attention matrices computed per token: the k selected experts."""
        return self.k

    def param_count(self) -> int:
        """E·(d·d_h + d_h·d) expert Q/O, 2·d·d_h shared K/V, E·d router, d·d_h XL projection."""
        D, C, E = self.d_model, self.d_head, self.n_experts
        n = 2 * E * D * C + 2 * D * C + E * D
        if self.pos == "xl":
            n += D * C
        return n

    def build(self) -> "MoAAttention":
        return MoAAttention(self)


class MoAAttention(KVCacheAttention):
    def __init__(self, config: MoAConfig):
        super().__init__()
        self.config = c = config
        D, C, E = c.d_model, c.d_head, c.n_experts
        self.w_q = nn.Parameter(torch.empty(E, D, C))
        self.w_k = nn.Parameter(torch.empty(D, C))
        self.w_v = nn.Parameter(torch.empty(D, C))
        self.w_o = nn.Parameter(torch.empty(E, C, D))
        self.w_router = nn.Parameter(torch.zeros(E, D))
        # Slot j of the k selected experts is head j of the core; K/V and the XL projection are
        # one head shared by the slots.
        self.core = AttentionCore(core_config(c, n_heads=c.k, n_kv_heads=1, xl_heads=1))
        self._weight_memo: dict = {}  # fused projection weights (project_by_input)
        register_usage(self, "usage", (E,))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Q, K, V and the position projection ~ N(0, (s/sqrt(d))²); W_o ~ N(0, (s/sqrt(k·d_h))²)
        (the k selected heads are summed, as SwitchHead's H heads); the router is zero (MoA)."""
        c = self.config
        s = init_scale(c.n_layers)
        std_in, std_out = s / math.sqrt(c.d_model), s / math.sqrt(c.k * c.d_head)
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                if name == "w_router":
                    p.zero_()
                else:
                    p.normal_(0.0, std_out if name == "w_o" else std_in)
            if c.pos == "xl":
                self.core.w_pos.normal_(0.0, std_in)

    def forward(self, q_BTD, kv_BSD=None, *, causal=True, cache=None, pos_q=None, pos_k=None,
                valid_k=None):
        """docs/interfaces.md. ``aux.losses``: "balance", "z", "cv" (each when its coefficient is
        non-zero); ``aux.routing["router"]``: the selected heads, counts [1, E] (valid tokens only,
        also added to the ``usage`` buffer in training mode); ``aux.stats``: "router_entropy"."""
        c = self.config
        check_inputs(q_BTD, kv_BSD, c.d_model)
        B, T, D = q_BTD.shape
        M, K = B * T, c.k
        logits_ME, top, plan, q_BKTC, k_B1SC, v_B1SC = self._qkv(q_BTD, kv_BSD)
        o_BKTC = self.core(q_BKTC, k_B1SC, v_B1SC, causal=causal, self_attention=kv_BSD is None,
                           cache=cache, pos_q=pos_q, pos_k=pos_k, valid_k=valid_k)
        # One row per (token, slot): each slot's attention output through its own expert's W_o.
        # sum_rows=K sums a token's K slots inside the expert matmul (no [M·K, D] product).
        rows_NC = o_BKTC.transpose(1, 2).reshape(M * K, c.d_head)
        y_BTD = expert_matmul(rows_NC, top.idx.view(M * K, 1), self.w_o, top.gates.view(M * K, 1),
                              sum_rows=K, impl=c.expert_impl, plan=plan).view(B, T, D)

        valid_BT = destination_validity(valid_k, kv_BSD, T, causal)
        valid_M = None if valid_BT is None else valid_BT.reshape(M)
        return y_BTD, self._aux(logits_ME, top, valid_M)

    def _qkv(self, q_BTD, kv_BSD):
        """The one projection path of ``forward`` and ``inspect``: the router's logits and top-k,
        the shared plan, the expert queries [B, K, T, C] and the shared K, V [B, 1, S, C]."""
        c = self.config
        src_BSD = q_BTD if kv_BSD is None else kv_BSD
        B, T, D = q_BTD.shape
        S, C, E, K = src_BSD.shape[1], c.d_head, c.n_experts, c.k
        x_MD = q_BTD.reshape(B * T, D)
        logits_ME = selection_logits(x_MD, self.w_router)
        top = softmax_topk(logits_ME, K, renormalize=c.renormalize)
        plan = None if planless(c.expert_impl) else make_plan(top.idx, E)
        q_MKC = expert_matmul(x_MD, top.idx, self.w_q, impl=c.expert_impl, plan=plan)
        q_BKTC = q_MKC.view(B, T, K, C).transpose(1, 2)
        # The shared K and V in one matmul, except with RoPE (project_by_input).
        proj = project_by_input([("k", src_BSD, self.w_k)]
                                + ([] if c.pos == "rope" else [("v", src_BSD, self.w_v)]),
                                self._weight_memo)
        v_BSC = proj["v"] if "v" in proj else src_BSD @ self.w_v
        return logits_ME, top, plan, q_BKTC, proj["k"].view(B, 1, S, C), v_BSC.view(B, 1, S, C)

    @torch.no_grad()
    def inspect(self, q_BTD, kv_BSD=None, *, causal=True, pos_q=None, pos_k=None, valid_k=None):
        """For analysis: ``probs_BHTS`` with one map per selected-head slot (slot j of token t is
        its j-th selected expert, ``heads_BTK``), and the router's kept gates scattered over the
        experts, ``sel_dst_BTE``; forward-pass code paths, no cache, no dropout."""
        c = self.config
        check_inputs(q_BTD, kv_BSD, c.d_model)
        B, T, _ = q_BTD.shape
        _, top, _, q_BKTC, k_B1SC, _ = self._qkv(q_BTD, kv_BSD)
        probs = self.core.probs(q_BKTC, k_B1SC, causal=causal, self_attention=kv_BSD is None,
                                pos_q=pos_q, pos_k=pos_k, valid_k=valid_k)
        gates_ME = torch.zeros(B * T, c.n_experts, device=q_BTD.device).scatter_(
            1, top.idx, top.gates)
        return {"probs_BHTS": probs, "heads_BTK": top.idx.view(B, T, c.k),
                "sel_dst_BTE": gates_ME.view(B, T, c.n_experts)}

    def _aux(self, logits_ME, top, valid_M) -> Aux:
        c = self.config
        E = c.n_experts
        aux = Aux()
        if c.balance_coef:
            aux.losses["balance"] = c.balance_coef * moa_balance_loss(top.scores, top.idx, valid_M)
        if c.z_coef:
            aux.losses["z"] = c.z_coef * z_loss(logits_ME, valid_M)
        w_M = None if valid_M is None else valid_M.to(torch.float32)
        if c.cv_coef:
            gates_ME = torch.zeros_like(top.scores).scatter(1, top.idx, top.gates)
            if w_M is not None:
                gates_ME = gates_ME * w_M[:, None]
            aux.losses["cv"] = c.cv_coef * cv_squared(gates_ME.sum(0))
        keep = None if valid_M is None else valid_M[:, None]
        aux.routing["router"] = record = routing_record("moa", top.idx, E, top.gates, keep)
        aux.stats["router_entropy"] = router_entropy(top.scores, valid_M).detach()
        accumulate_usage(self, "usage", record)
        return aux
