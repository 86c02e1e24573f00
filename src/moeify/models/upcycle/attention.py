"""Dense multi-head attention -> SwitchHead or MoA, reusing the dense heads' projections.

Dense (layers/attention.py), heads j = 0..H_d-1 of width C:
    y = Σ_j softmax(q_j k_jᵀ · scale [+ XL terms]) (x W_V,j) W_O,j

SwitchHead (H kept heads, E experts each, H · E = H_d, the same C; SwitchHead §3 matches H·E to the
dense head count): dense heads are grouped by index, group h = {h·E, ..., h·E + E-1}.
    kept head h:          Q / K (and the XL position projection) of dense head h·E
    V / O expert (h, e):  W_V and W_O of dense head h·E + e
A dense V or O (``experts`` without it) takes dense head h·E's. Gates sigmoid(s) start at about
1/2 (router near 0): every expert weight is doubled to cancel them, and W_O is further divided
by E (below).
    Preserves: kept head h's attention pattern is exactly dense head h·E's (RoPE or no
    positions; with XL the learned scale is folded into W_Q, but SwitchHead has no content and
    position biases u, v, so those are lost). Not the function: head h outputs
    c · A_h x (Σ_{e' ∈ sel_V} W_V,e') (Σ_{e ∈ sel_O} W_O,e): besides the group's dense terms
    A_h x W_V,e W_O,e (with A_h in place of each member's own pattern) it holds the cross terms
    e ≠ e'. Taking the cross terms as orthogonal to the dense ones, the scale c minimising the
    expected squared error of the head's operator is 1/E for every k (a dense term survives
    with probability (k/E)², among k² terms), hence W_O / E. Measured on a small trained
    model: W_O without the 1/E gave a higher loss right after conversion. Training starts from
    the dense heads' subspaces, not from the dense function; tests hold the loss gap to a
    stated bound.

Imported multi-head attention (GroupedQueryAttentionConfig with n_kv_heads = n_heads: GPT-2,
or a Llama-family model without grouping) converts to SwitchHead by the same mapping, with its
RoPE (base and fraction) or, for learned absolute positions, no positions inside the layer (the
model's position embedding is kept). SwitchHead has no biases, so the Q / K / V and output
biases are dropped. Without RoPE (GPT-2) the K bias changes no attention pattern (q · b_K is
the same for every key); with RoPE it does (each key rotates it by its own position). The Q
bias does too. So the kept patterns equal the dense heads' for GPT-2 with a zero Q bias, and
for RoPE with zero Q and K biases. The V and output biases, which add the constant
b_V W_O + b_O to every token, are lost. Grouped-query
attention (n_kv_heads < n_heads) is refused: each SwitchHead head has its own K and V.

MoA (E = H_d experts, k selected per token, the same C; MoA's shared key/value is single-head):
    shared K / V:        dense head ``kv_head``'s (and its XL position projection)
    expert e:            dense head e's Q and O, fitted to the shared K / V by least squares in
                         weight space: W_Q,e' = W_Q,e W_K,eᵀ (W_K,sharedᵀ)⁺ so that
                         W_Q,e' W_K,sharedᵀ is the closest to head e's logit form W_Q,e W_K,eᵀ,
                         and W_O,e' = W_V,shared⁺ W_V,e W_O,e for its value-output map
The router (softmax) starts near 0, so the k kept gates are about 1/E each: W_O is multiplied
by E.
    Preserves: head ``kv_head`` exactly (its projections are its own); head e only the part of
    its logit and value maps that lies in the shared head's C-dimensional key / value subspace
    (with RoPE the fitted query mixes rotated channels, so even that part is approximate); with
    XL the u, v biases are lost. With k = H_d and router_scale = 0 every head is computed; with
    k < H_d a token keeps k of them. Measured on a small trained model the fit lowers the loss
    right after conversion well below that of the unfitted Q / O.

MoH (Jin et al. 2025, arXiv 2410.11842; moeify.layers.moh): the dense heads become MoH's heads
one for one, every projection copied as it is: Q, K, V and O of each head, grouped-query key /
value heads, the biases, the positions (RoPE, XL's projection, u, v and scale, or the model's
learned positions). Heads 0 .. ``shared`` - 1 are the shared ones, the others routed, ``k`` of
them kept per token. The paper continue-tunes LLaMA3-8B into MoH this way (Sec. 4.4).
    router "learned": W_s and W_h zero, so the shared gates and [α1, α2] start at exactly 1
      (the authors' scaled gates, ``weights="authors"``: h_s · 1/h_s, 2 · 1/2); W_r is
      ``router_scale`` times a fresh N(0, s²/d) draw (0: all routed gates K · (1/R) / (K/R) = 1,
      ties going to the lowest head index).
    router "query_norm" (the authors' MoH-LLaMA3 router): no weights; gates 1 or 0.
    Preserves: with k = every routed head (and router_scale 0, or the query-norm router) the
    function exactly: every gate is 1, the unweighted sum of multi-head attention
    (tests/models/test_upcycle_moh.py). With k < the routed heads each token keeps the shared
    heads and k routed heads exactly (their attention patterns, values and output maps), with
    gates 1 (zero or query-norm router) or within O(router_scale) of 1, and loses the other
    heads' terms of the output sum. Grouped-query attention (LLaMA3) converts as it is; Q/K
    normalisation (Qwen3, OLMoE) is refused: MoH's heads have no Q/K norm.

Shape legend: D d_model, H_d dense heads, H kept heads, E experts, C d_head.
"""

from __future__ import annotations

import math

import torch

from moeify.layers.attention import DenseAttention
from moeify.layers.common import init_scale, renorm_rows_
from moeify.layers.gqa import GroupedQueryAttention
from moeify.layers.moa import MoAAttention, MoAConfig
from moeify.layers.moh import ROUTERS as MOH_ROUTERS
from moeify.layers.moh import MoHAttention, MoHConfig
from moeify.layers.switchhead import SwitchHeadAttention, SwitchHeadConfig
from moeify.models.upcycle.common import generator, head_view, small_router

SWITCHHEAD_EXPERTS = frozenset({"v", "o"})


def _dense(attn, kind: str) -> tuple:
    if kind == "switchhead" and isinstance(attn, GroupedQueryAttention):
        return _imported(attn)
    if not isinstance(attn, DenseAttention):
        raise ValueError(f"{kind}: only dense multi-head attention (DenseAttentionConfig"
                         f"{' or imported multi-head attention' if kind == 'switchhead' else ''})"
                         f" converts, got {type(attn).__name__}")
    c = attn.config
    H, C = c.n_heads, c.d_head
    w = {p: head_view(getattr(attn, f"w_{p}").detach().float(), H, C, rows=False)
         for p in ("q", "k", "v")}  # [H, D, C]
    w["o"] = head_view(attn.w_o.detach().float(), H, C, rows=True)  # [H, C, D]
    if c.pos == "xl":
        w["pos"] = head_view(attn.core.w_pos.detach().float(), H, C, rows=False)
        # SwitchHead / MoA use the fixed 1/sqrt(C): q' = q · scale · sqrt(C) keeps the logits.
        w["q"] = w["q"] * (attn.core.scale.detach().float() * math.sqrt(C))
    return c, w


def _imported(attn: GroupedQueryAttention) -> tuple:
    """The per-head weights of imported multi-head attention (nn.Linear [out, in]); its biases
    are not kept (module docstring)."""
    c = attn.config
    if c.n_kv_heads != c.n_heads:
        raise ValueError(f"switchhead: grouped-query attention ({c.n_kv_heads} key/value heads "
                         f"for {c.n_heads} query heads) does not convert: each SwitchHead head "
                         "has its own K and V; only multi-head attention (n_kv_heads = n_heads) "
                         "does")
    H, C = c.n_heads, c.d_head
    w = {p: head_view(getattr(attn, f"w_{p}").weight.detach().float().t(), H, C, rows=False)
         for p in ("q", "k", "v")}
    w["o"] = head_view(attn.w_o.weight.detach().float().t(), H, C, rows=True)
    return c, w


def _common(c) -> dict:
    # "absolute": the positions are the model's learned embedding, none inside the layer.
    return dict(d_model=c.d_model, d_head=c.d_head,
                pos="none" if c.pos == "absolute" else c.pos, n_layers=c.n_layers,
                attn_dropout=c.attn_dropout, rope_fraction=c.rope_fraction,
                rope_base=c.rope_base, attn_impl=c.attn_impl)


def _cat_heads(w_HDC: torch.Tensor) -> torch.Tensor:
    """[H, D, C] -> the dense [D, H·C] layout."""
    return w_HDC.permute(1, 0, 2).reshape(w_HDC.shape[1], -1)


def to_switchhead(attn: DenseAttention | GroupedQueryAttention, *, n_experts: int, k: int | None = None,
                  experts: str | frozenset = "vo", router_scale: float = 0.1,
                  seed: int = 0) -> SwitchHeadAttention:
    """Dense attention as SwitchHead with H = H_d / n_experts heads (module docstring)."""
    c, w = _dense(attn, "switchhead")
    E = n_experts
    k = E if k is None else k
    names = frozenset(experts)
    if not names or not names <= SWITCHHEAD_EXPERTS:
        raise ValueError(f"switchhead: experts must be v, o or vo (the kept heads take Q/K from "
                         f"dense heads), got {''.join(sorted(names)) or 'nothing'}")
    if c.n_heads % E:
        raise ValueError(f"switchhead: H·E must equal the dense head count {c.n_heads}; E={E} "
                         f"does not divide it (choose E among the divisors of {c.n_heads})")
    H = c.n_heads // E
    cfg = SwitchHeadConfig(n_heads=H, n_experts=E, k=k, experts=names, **_common(c))
    rep = torch.arange(H) * E  # kept head h takes dense head h·E's dense projections
    out = SwitchHeadAttention(cfg)
    gen = generator(seed)
    s = init_scale(c.n_layers)
    with torch.no_grad():
        for p in ("q", "k", "v"):
            target = getattr(out, f"w_{p}")
            # 2 = 1 / sigmoid(0): the expert gates start at about 1/2.
            target.copy_(2.0 * w[p] if p in names else _cat_heads(w[p][rep]))
        # 1 / E: the least-squares scale of the head's cross terms (module docstring).
        out.w_o.copy_((2.0 / E) * w["o"] if "o" in names
                      else w["o"][rep].reshape(-1, c.d_model) / E)
        if c.pos == "xl":
            out.core.w_pos.copy_(_cat_heads(w["pos"][rep]))
        for name, p in out.named_parameters(recurse=False):
            if name.startswith("w_router"):
                p.copy_(renorm_rows_(small_router(tuple(p.shape), s / c.d_model ** 0.5,
                                                  router_scale, gen))
                        if router_scale > 0 else torch.zeros_like(p))
    return out


def to_moa(attn: DenseAttention, *, k: int, kv_head: int = 0, router_scale: float = 0.1,
           seed: int = 0) -> MoAAttention:
    """Dense attention as MoA with one expert per dense head (module docstring)."""
    c, w = _dense(attn, "moa")
    E = c.n_heads
    if not 0 <= kv_head < E:
        raise ValueError(f"moa: kv_head must be a dense head index in [0, {E - 1}], got "
                         f"{kv_head}")
    if not 1 <= k <= E:
        raise ValueError(f"moa: k must lie in [1, {E}] (one expert per dense head), got {k}")
    cfg = MoAConfig(n_experts=E, k=k, **_common(c))
    out = MoAAttention(cfg)
    gen = generator(seed)
    k_DC, v_DC = w["k"][kv_head], w["v"][kv_head]
    # Least-squares fits to the shared key / value (module docstring): [E, D, C] and [E, C, D].
    q_EDC = w["q"] @ (w["k"].transpose(1, 2) @ torch.linalg.pinv(k_DC).t())
    o_ECD = torch.linalg.pinv(v_DC) @ w["v"] @ w["o"]
    with torch.no_grad():
        out.w_q.copy_(q_EDC)
        out.w_k.copy_(k_DC)
        out.w_v.copy_(v_DC)
        # Softmax gates start at 1/E each (router near 0): E cancels them.
        out.w_o.copy_(o_ECD * E)
        if c.pos == "xl":
            out.core.w_pos.copy_(w["pos"][kv_head])
        out.w_router.copy_(small_router((E, c.d_model),
                                        init_scale(c.n_layers) / c.d_model ** 0.5,
                                        router_scale, gen))
    return out


def to_moh(attn: DenseAttention | GroupedQueryAttention, *, shared: int, k: int,
           router: str = "learned", router_scale: float = 0.1, balance_coef: float = 0.01,
           seed: int = 0) -> MoHAttention:
    """Dense attention as MoH over the same heads (module docstring)."""
    if router not in MOH_ROUTERS:
        raise ValueError(f"moh: router must be one of {', '.join(MOH_ROUTERS)}, got {router!r}")
    c = attn.config
    if isinstance(attn, GroupedQueryAttention):
        if c.qk_norm != "none":
            raise ValueError(f"moh: attention with Q/K normalisation (qk_norm={c.qk_norm!r}) "
                             "does not convert: MoH's heads have no Q/K norm; leave the "
                             "attention dense")
        extra = dict(n_kv_heads=c.n_kv_heads, qkv_bias=c.qkv_bias, out_bias=c.out_bias)
        pos = c.pos
    elif isinstance(attn, DenseAttention):
        extra, pos = {}, c.pos
    else:
        raise ValueError(f"moh: only dense or imported multi-head attention converts, got "
                         f"{type(attn).__name__}")
    if not isinstance(shared, int) or isinstance(shared, bool) or not 0 <= shared < c.n_heads:
        raise ValueError(f"moh: shared must be an integer in [0, {c.n_heads - 1}] (the dense "
                         f"model has {c.n_heads} heads; at least one is routed), got {shared!r}")
    cfg = MoHConfig(d_model=c.d_model, n_heads=c.n_heads, d_head=c.d_head, n_shared=shared, k=k,
                    router=router, balance_coef=balance_coef, pos=pos, n_layers=c.n_layers,
                    attn_dropout=c.attn_dropout, rope_fraction=c.rope_fraction,
                    rope_base=c.rope_base, attn_impl=c.attn_impl, **extra)
    out = MoHAttention(cfg)
    gen = generator(seed)
    with torch.no_grad():
        if isinstance(attn, GroupedQueryAttention):
            for p in ("q", "k", "v", "o"):
                lin = getattr(attn, f"w_{p}")
                getattr(out, f"w_{p}").copy_(lin.weight.detach().t())
                if lin.bias is not None:
                    getattr(out, f"bias_{p}").copy_(lin.bias.detach())
        else:
            for p in ("q", "k", "v", "o"):
                getattr(out, f"w_{p}").copy_(getattr(attn, f"w_{p}").detach())
        out.core.load_state_dict(attn.core.state_dict())
        for name, shape in cfg.router_shapes().items():
            w = getattr(out, name)
            # small_router: zero at router_scale 0, refuses a negative one
            scale = router_scale if name == "w_router" else 0.0
            w.copy_(small_router(shape, init_scale(c.n_layers) / c.d_model ** 0.5, scale, gen))
    return out
