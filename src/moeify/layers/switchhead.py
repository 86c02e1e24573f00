"""SwitchHead: Mixture-of-Experts attention (Csordás et al., NeurIPS 2024,
arXiv 2312.07987: Eq. 7-10 and the appendix).

Shape legend
    B batch     T destination (query) tokens    S source (key/value) tokens, memory included
    D d_model   H heads     E experts per head  K experts kept per head (k)   C d_head
    M routed rows (B·T or B·S)                  X = H·E expert matrices per projection

Per head h, with sigmoid selection scores computed in float32 (Eq. 7-8) and top-k per head:
    V_h[s] = Σ_{e ∈ topk_h(s)} s_SV[s,h,e] · x_src[s] W_V[h,e]                        (Eq. 9)
    A_h    = softmax(Q_h K_hᵀ / sqrt(C) + mask [+ XL position term])
    y[t]   = Σ_h Σ_{e ∈ topk_h(t)} s_SO[t,h,e] · (A_h V_h)[t] W_O[h,e]                   (Eq. 10)
No renormalisation of the k gates, heads summed (no concatenation), no regulariser in the
SwitchHead paper. MoEUT adds one (``entropy_coef`` = its delta, 0.001 there; 0 = off, the
default): per selection (V's and O's), minus the entropy of the selection softmax averaged per
sequence over its tokens and over every application of a shared layer, averaged over sequences
and heads (RobertCsordas/moeut, moeut.py, SwitchHeadCore.get_reg_loss:
``entropy_reg(stack([o_sel, v_sel][i] over applications, -3).flatten(-4, -3), -3)``), returned
in ``Aux.pooled`` ("entropy.src", "entropy.dst") for the model to pool (moeify.models.lm).

Any subset of {q, k, v, o} may be experts (Table 6). At most two selections exist: the
destination-side one (computed from the query input) serves O and Q, the source-side one
(computed from the key/value input, memory included) serves V and K; with ``shared_selection``
one selection matrix serves both sides, and in self-attention its scores are computed once.

Speed: each selection's top-k is taken once and its routing plan built once (``make_plan``,
grouped by head: ``group_size=E``); every expert matmul sharing it reuses that plan and the
layouts cached on it. On CPU that is the set layout (moeify.ops.moe.cpu.sets: the (token,
head) units sorted by their set of k experts, each set's k matrices side by side in one matmul)
once there are enough units per set, else the padded layout (moeify.ops.moe.cpu.padded: one
batched matmul for all H·E experts); the policy (moeify.ops.moe.policy) decides. Source-side experts run with rows = source tokens, ids = h·E + e
and ``groups=H`` and come out as [B, H, S, C], the layout attention takes, so the gate-weighted
sum per head never materialises a [rows, k, C] tensor; O experts run with rows = destination
tokens × heads and ``sum_rows=H``, so the sum over heads happens inside the expert matmul too. Dense Q / K projections and the
selection logits that read the same input share one matmul (``_fused_projections``). The
attention core stays on scaled_dot_product_attention for RoPE and no positions; XL runs the
fused core of moeify.ops.xl_attention.

Decoding (a handful of rows, no gradient, where the policy's ``decodes_all`` holds): the Q / K /
V experts join that fused matmul for every expert and are gate-weighted per head afterwards
(``gated_sum_of_all``), and the O experts are one GEMM over every expert
(``gated_group_sum_all``): a decode step calls no expert matmul.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

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
    PooledEntropy,
    accumulate_usage,
    check_expert_impl,
    check_positive,
    init_scale,
    register_usage,
    routing_record,
    renorm_rows_keep_row_std_,
)
from moeify.layers.kv_cache import KVCacheAttention
from moeify.layers.projection import project_by_input
from moeify.ops.aux_losses import sequence_prob_sums
from moeify.ops.moe import RoutingPlan, expert_matmul, make_plan
from moeify.ops.moe.cpu.decoding import gated_group_sum_all, gated_sum_of_all
from moeify.ops.moe.cpu.policy import decodes_all
from moeify.ops.moe.matmul import trace
from moeify.ops.moe.policy import planless
from moeify.ops.routing import selection_logits, sigmoid_topk

EXPERT_NAMES = ("q", "k", "v", "o")
SOURCE_SIDE = frozenset({"k", "v"})
DEST_SIDE = frozenset({"q", "o"})


@dataclass(frozen=True, kw_only=True)
class SwitchHeadConfig:
    """SwitchHead attention.

    experts: which projections are experts, a subset of {"q", "k", "v", "o"} (default V and O).
    shared_selection: one selection matrix for both sides (Tables 4 and 8); needs experts on both
        sides (V or K, and O or Q).
    n_layers: model depth L for the init s = sqrt(2 / L) (SwitchHead appendix).
    attn_dropout: dropout on attention probabilities (never used in the paper).
    entropy_coef: MoEUT's attention entropy regulariser delta (0.001 in MoEUT; 0 = none, as the
        SwitchHead paper), pooled per sequence over a shared layer's applications.
    expert_impl: expert-matmul implementation ("auto", "reference", "gather", "all", "segment",
        "grouped", "padded", "sets", "triton"); attn_impl: attention core ("auto" or "reference").
    """

    d_model: int
    n_heads: int
    d_head: int
    n_experts: int
    k: int
    experts: frozenset[str] = field(default_factory=lambda: frozenset({"v", "o"}))
    shared_selection: bool = False
    pos: str = "xl"
    n_layers: int = 1
    attn_dropout: float = 0.0
    rope_fraction: float = 0.5
    rope_base: float = 10000.0
    attn_impl: str = "auto"
    expert_impl: str = "auto"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        check_positive(self, "n_heads", "n_experts", "k")
        if not self.entropy_coef >= 0:
            raise ValueError(f"SwitchHeadConfig.entropy_coef must be >= 0, got "
                             f"{self.entropy_coef!r}")
        check_attention_common(self)
        if isinstance(self.experts, str):
            raise ValueError(f"experts must be a collection of names such as {{'v', 'o'}}, "
                             f"got the string {self.experts!r}")
        names = frozenset(self.experts)
        unknown = sorted(n for n in names if n not in EXPERT_NAMES)
        if unknown:
            raise ValueError(f"unknown expert projection(s) {unknown}; choose from "
                             f"{', '.join(EXPERT_NAMES)}")
        if not names:
            raise ValueError("experts is empty; name at least one of q, k, v, o "
                             "(or use DenseAttentionConfig for plain attention)")
        object.__setattr__(self, "experts", names)
        if self.k > self.n_experts:
            raise ValueError(f"k={self.k} exceeds n_experts={self.n_experts}; "
                             f"choose k in [1, {self.n_experts}]")
        check_expert_impl(self, sets=True)
        if self.shared_selection and not (self.source_side and self.dest_side):
            raise ValueError("shared_selection needs experts on both sides (v or k, and o or q); "
                             f"experts={sorted(names)} has a single selection anyway")

    @property
    def source_side(self) -> bool:
        return bool(self.experts & SOURCE_SIDE)

    @property
    def dest_side(self) -> bool:
        return bool(self.experts & DEST_SIDE)

    @property
    def n_selections(self) -> int:
        return 1 if self.shared_selection else int(self.source_side) + int(self.dest_side)

    def param_count(self) -> int:
        """Per projection: H·E·d·d_h as experts, d·H·d_h dense; d·H·E per selection matrix;
        d·H·d_h for the XL position projection (SwitchHead Eq. 7-10; §6's n_sels)."""
        D, H, C, E = self.d_model, self.n_heads, self.d_head, self.n_experts
        n = sum(H * E * D * C if p in self.experts else D * H * C for p in EXPERT_NAMES)
        n += self.n_selections * D * H * E
        if self.pos == "xl":
            n += D * H * C
        return n

    def build(self) -> "SwitchHeadAttention":
        return SwitchHeadAttention(self)


class Selection(NamedTuple):
    """One side's routing. Rows M are tokens in (batch, position) order."""

    gates: torch.Tensor  # float32 [M, H, K], raw sigmoid values (differentiable)
    idx: torch.Tensor  # int64 [M, H, K], expert within the head
    ids: torch.Tensor  # int64 [M, H, K], h·E + idx: the row of the stacked [H·E, ...] weights
    plan: RoutingPlan | None  # sorted routing shared by every expert matmul of this side
    logits: torch.Tensor | None = None  # [M, H, E] selection logits (MoEUT's regulariser)


class SwitchHeadAttention(KVCacheAttention):
    # Compute dense Q / K together with the selection logits of the same input (outside
    # autocast); False computes them separately, as the reference the tests compare against.
    fuse_selection: bool = True

    def __init__(self, config: SwitchHeadConfig):
        super().__init__()
        self.config = c = config
        D, H, C, E = c.d_model, c.n_heads, c.d_head, c.n_experts
        X = H * E
        for p in ("q", "k", "v"):
            shape = (X, D, C) if p in c.experts else (D, H * C)
            setattr(self, f"w_{p}", nn.Parameter(torch.empty(shape)))
        self.w_o = nn.Parameter(torch.empty((X, C, D) if "o" in c.experts else (H * C, D)))
        # Selection (router) weights [X, D] (moeify.layers.common: the naming convention).
        if c.shared_selection:
            self.w_router = nn.Parameter(torch.empty(X, D))
        else:
            if c.source_side:
                self.w_router_src = nn.Parameter(torch.empty(X, D))
            if c.dest_side:
                self.w_router_dst = nn.Parameter(torch.empty(X, D))
        self.core = AttentionCore(core_config(c, n_heads=H))
        self._weight_memo: dict = {}  # fused projection weights (project_by_input)
        self.register_buffer("head_offset", torch.arange(H) * E, persistent=False)
        for p in sorted(c.experts):
            register_usage(self, f"usage_{p}", (H, E))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Spec §3: W_Q, W_K, W_V, W_S and the position projection ~ N(0, (s/sqrt(d))²), W_O ~
        N(0, (s/sqrt(H·d_h))²), s = sqrt(2/L); selection rows then rescaled as the authors'
        code does (``renorm_rows_keep_row_std_``: each row's norm proportional to its std)."""
        c = self.config
        s = init_scale(c.n_layers)
        std_in, std_out = s / math.sqrt(c.d_model), s / math.sqrt(c.n_heads * c.d_head)
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                p.normal_(0.0, std_out if name == "w_o" else std_in)
                if name.startswith("w_router"):
                    renorm_rows_keep_row_std_(p)
            if c.pos == "xl":
                self.core.w_pos.normal_(0.0, std_in)

    # ------------------------------------------------------------------------------------------

    def _sel_weight(self, side: str) -> torch.Tensor:
        return (self.w_router if self.config.shared_selection
                else getattr(self, f"w_router_{side}"))

    def _route(self, x_BND: torch.Tensor, w_XD: torch.Tensor,
               logits_BNX: torch.Tensor | None = None) -> Selection:
        """One side's selection from its input (or from ``logits_BNX`` = x · w_XDᵀ, when the
        caller has computed them together with a dense projection)."""
        c = self.config
        B, N, D = x_BND.shape
        if logits_BNX is None:
            logits_BNX = selection_logits(x_BND.reshape(B * N, D), w_XD)
        logits_MHE = logits_BNX.reshape(B * N, c.n_heads, c.n_experts)
        top = sigmoid_topk(logits_MHE, c.k)  # Eq. 7-8: float32 sigmoid, no renormalisation
        ids = top.idx + self.head_offset[:, None]
        plan = None
        if not planless(c.expert_impl):
            plan = make_plan(ids, c.n_heads * c.n_experts, group_size=c.n_experts,
                             in_range=True)  # a top-k within each head, plus its offset
        return Selection(top.gates, top.idx, ids, plan, logits_MHE)

    def select(self, q_BTD: torch.Tensor, kv_BSD: torch.Tensor | None = None, *,
               logits: dict[str, torch.Tensor] | None = None) -> dict[str, Selection]:
        """The routing of both sides: "src" from the key/value input (V, K), "dst" from the
        query input (O, Q). Only the sides that have experts are present. ``logits`` holds
        precomputed selection logits by side (``_fused_projections``)."""
        c = self.config
        logits = logits or {}
        out: dict[str, Selection] = {}
        src_BSD = q_BTD if kv_BSD is None else kv_BSD
        if c.source_side:
            out["src"] = self._route(src_BSD, self._sel_weight("src"), logits.get("src"))
        if c.dest_side:
            if c.shared_selection and kv_BSD is None:
                out["dst"] = out["src"]  # same matrix, same tokens: compute once
            else:
                out["dst"] = self._route(q_BTD, self._sel_weight("dst"), logits.get("dst"))
        return out

    def _fused_projections(self, q_BTD: torch.Tensor, kv_BSD: torch.Tensor | None,
                           value_BSD: torch.Tensor | None = None
                           ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The dense Q / K projections and the selection logits, those that read the same
        input in one matmul (``project_by_input``: x · [W_K | W_Sᵀ] over the source, and in
        self-attention without memory all of them over x); the selections are only H·E columns
        wide, too narrow for a matmul of their own. Only outside autocast, where the logits are
        in the input's precision anyway (under autocast they must stay float32). Returns
        ({"q" / "k": [B, H, N, C], "q@all" / "k@all" / "v@all": [B, N, H·E·C]},
        {"dst" / "src": logits [B, N, H·E]}).

        Decoding (no gradient, a handful of rows, where "auto" runs the "all" layout): the
        expert projections of Q, K, V go into the same matmul for every expert (``name@all``,
        the weights as a [D, H·E·C] view, concatenated once and kept in the memo), which
        ``_qkv`` gate-weights per head; reading the weights is then one pass, not one call per
        projection."""
        c = self.config
        if not self.fuse_selection or torch.is_autocast_enabled(q_BTD.device.type):
            return {}, {}
        src_BSD = q_BTD if kv_BSD is None else kv_BSD
        shared_once = c.shared_selection and kv_BSD is None  # the source's selection serves both
        inputs = {"q": q_BTD, "k": src_BSD, "v": src_BSD if value_BSD is None else value_BSD}
        pieces = [(n, inputs[n], getattr(self, f"w_{n}")) for n in ("k", "q")
                  if n not in c.experts]
        pieces += [(f"{n}@all", inputs[n], getattr(self, f"w_{n}").permute(1, 0, 2))
                   for n in ("q", "k", "v") if self._decodes_all(n, inputs[n])]
        if c.source_side:
            pieces.append(("src", src_BSD, self._sel_weight("src").t()))
        if c.dest_side and not shared_once:
            pieces.append(("dst", q_BTD, self._sel_weight("dst").t()))
        out = project_by_input(pieces, self._weight_memo)
        H, C = c.n_heads, c.d_head
        projs = {n: y.view(*y.shape[:2], H, C).transpose(1, 2) for n, y in out.items()
                 if n in ("q", "k")}
        projs.update((n, y) for n, y in out.items() if n.endswith("@all"))
        return projs, {side: y for side, y in out.items() if side in ("src", "dst")}

    def _decodes_all(self, name: str, x: torch.Tensor) -> bool:
        """Whether expert projection ``name`` runs every expert for its rows outside
        expert_matmul (Q / K / V: in the fused matmul; O: ``_output``), as the policy decides
        (``decodes_all``: a few rows on CPU, no gradient to the weights, which the memo keeps
        fused between calls). ``x``: the projection's input, [..., D] (O: the attention output
        [B, H, T, C])."""
        c = self.config
        if name not in c.experts:
            return False
        x_MD = x.reshape(-1, x.shape[-1])
        pairs = x_MD.shape[0] * c.k * (c.n_heads if name != "o" else 1)
        return decodes_all(c.expert_impl, x_MD, getattr(self, f"w_{name}"), pairs)

    def _from_all(self, y_BNF: torch.Tensor, sel: Selection) -> torch.Tensor:
        """Eq. 9 from every expert's product y_BNF = x · [W[h, e] for all h, e] (the "all"
        layout): per head the gate-weighted sum over its selected experts, [B, H, N, C]."""
        c = self.config
        B, N = y_BNF.shape[:2]
        H, E, C = c.n_heads, c.n_experts, c.d_head
        with trace("all"):
            y_MHC = gated_sum_of_all(y_BNF.reshape(B * N, H, E, C), sel.idx, sel.gates)
        return y_MHC.view(B, N, H, C).transpose(1, 2)

    def _project(self, name: str, x_BND: torch.Tensor, sel: Selection | None) -> torch.Tensor:
        """Q, K or V as [B, H, N, C]: dense, or the gate-weighted expert sum per head (Eq. 9)."""
        c = self.config
        B, N, D = x_BND.shape
        H, C = c.n_heads, c.d_head
        w = getattr(self, f"w_{name}")
        if name not in c.experts:
            return (x_BND @ w).view(B, N, H, C).transpose(1, 2)
        HK = H * c.k
        # batch=B: [B, H, N, C] as attention takes it (written in that layout by "sets").
        return expert_matmul(x_BND.reshape(B * N, D), sel.ids.view(B * N, HK), w,
                             sel.gates.view(B * N, HK), groups=H, impl=c.expert_impl,
                             plan=sel.plan, batch=B)

    def _output(self, o_BHTC: torch.Tensor, sel: Selection | None) -> torch.Tensor:
        """Eq. 10: per head and selected expert, gate · (A_h V_h) W_O[h,e], summed over heads."""
        c = self.config
        B, H, T, C = o_BHTC.shape
        o_BTHC = o_BHTC.transpose(1, 2)
        if "o" not in c.experts:
            return o_BTHC.reshape(B, T, H * C) @ self.w_o
        if self._decodes_all("o", o_BHTC):
            with trace("all"):
                y = gated_group_sum_all(o_BTHC.reshape(B * T, H, C), sel.idx, sel.gates,
                                        self.w_o)
            return y.view(B, T, c.d_model)
        M = B * T * H
        # Rows are (token, head); sum_rows=H sums the heads inside the expert matmul.
        y = expert_matmul(o_BTHC.reshape(M, C), sel.ids.view(M, c.k), self.w_o,
                          sel.gates.view(M, c.k), sum_rows=H,
                          impl=c.expert_impl, plan=sel.plan)
        return y.view(B, T, c.d_model)

    def _qkv(self, q_BTD, kv_BSD, value_BSD=None):
        """The one projection path of ``forward`` and ``inspect``: Q, K, V as [B, H, N, C] and
        the selections by side. ``value_BSD``: V's input when it is not the K input (MoEUT's
        peri-layernorm, layers/moeut.py); the V selection still reads the K input."""
        src_BSD = q_BTD if kv_BSD is None else kv_BSD
        val_BSD = src_BSD if value_BSD is None else value_BSD
        projs, logits = self._fused_projections(q_BTD, kv_BSD, value_BSD)
        sels = self.select(q_BTD, kv_BSD, logits=logits)
        src, dst = sels.get("src"), sels.get("dst")
        q, k, v = (projs[n] if n in projs else
                   self._from_all(projs[f"{n}@all"], sel) if f"{n}@all" in projs else
                   self._project(n, x, sel)
                   for n, x, sel in (("q", q_BTD, dst), ("k", src_BSD, src), ("v", val_BSD, src)))
        return q, k, v, sels

    def forward(self, q_BTD, kv_BSD=None, *, causal=True, cache=None, pos_q=None, pos_k=None,
                valid_k=None, value_BSD=None):
        """docs/interfaces.md. ``aux.routing["src"]`` / ``["dst"]``: the source-side (V, K) and
        destination-side (O, Q) selections, counts [H, E] per head and expert (valid tokens
        only), also added to the ``usage_{p}`` buffers of the projections each serves in
        training mode. No aux losses (the paper uses none) unless ``entropy_coef`` (MoEUT):
        then ``aux.pooled["entropy.src"]`` / ``["entropy.dst"]``. ``value_BSD`` (same shape as the
        K input): V reads it instead of the K input (MoEUT's peri-layernorm: K, Q and both
        selections read LN(x), V reads x)."""
        c = self.config
        check_inputs(q_BTD, kv_BSD, c.d_model)
        if value_BSD is not None and value_BSD.shape != (q_BTD if kv_BSD is None
                                                          else kv_BSD).shape:
            raise ValueError("value_BSD must have the shape of the key/value input "
                             f"{tuple((q_BTD if kv_BSD is None else kv_BSD).shape)}, "
                             f"got {tuple(value_BSD.shape)}")
        q, k, v, sels = self._qkv(q_BTD, kv_BSD, value_BSD)
        o_BHTC = self.core(q, k, v, causal=causal, self_attention=kv_BSD is None, cache=cache,
                           pos_q=pos_q, pos_k=pos_k, valid_k=valid_k)
        dst = sels.get("dst")
        y_BTD = self._output(o_BHTC, dst)

        aux = Aux()
        valid = {"src": valid_k, "dst": destination_validity(valid_k, kv_BSD, q_BTD.shape[1],
                                                             causal)}
        for side, sel in sels.items():
            serves = tuple(sorted(c.experts & (SOURCE_SIDE if side == "src" else DEST_SIDE)))
            keep = None if valid[side] is None else valid[side].reshape(-1, 1, 1)
            record = routing_record("switchhead", sel.ids, c.n_experts, sel.gates, keep,
                                    groups=c.n_heads, serves=serves)
            aux.routing[side] = record
            for p in serves:
                accumulate_usage(self, f"usage_{p}", record)
            if c.entropy_coef != 0 and not (side == "dst" and sel is sels.get("src")):
                B = q_BTD.shape[0]
                aux.pooled[f"entropy.{side}"] = PooledEntropy(c.entropy_coef, *sequence_prob_sums(
                    sel.logits.reshape(B, -1, c.n_heads, c.n_experts), valid[side]))
        return y_BTD, aux

    @torch.no_grad()
    def inspect(self, q_BTD, kv_BSD=None, *, causal=True, pos_q=None, pos_k=None, valid_k=None,
                value_BSD=None):
        """For analysis (the paper's Figure 2): ``probs_BHTS``, the attention probabilities of the
        forward pass (no cache, no dropout), and per side with experts the kept gates scattered
        over each head's experts (0 = not selected): ``sel_dst_BTHE`` (O/Q, from the queries)
        and ``sel_src_BSHE`` (V/K, from the source tokens). ``value_BSD`` (MoEUT) changes
        neither, and is accepted so that a captured forward call can be replayed."""
        c = self.config
        check_inputs(q_BTD, kv_BSD, c.d_model)
        src_BSD = q_BTD if kv_BSD is None else kv_BSD
        q, k, _, sels = self._qkv(q_BTD, kv_BSD)
        out = {"probs_BHTS": self.core.probs(q, k, causal=causal, self_attention=kv_BSD is None,
                                             pos_q=pos_q, pos_k=pos_k, valid_k=valid_k)}
        for side, x_BND in (("dst", q_BTD), ("src", src_BSD)):
            if side in sels:
                sel = sels[side]
                B, N = x_BND.shape[:2]
                gates = torch.zeros(B * N, c.n_heads, c.n_experts, device=sel.gates.device)
                gates.scatter_(-1, sel.idx, sel.gates)
                out[f"sel_{side}_B{'T' if side == 'dst' else 'S'}HE"] = gates.view(
                    B, N, c.n_heads, c.n_experts)
        return out
