"""Exact cost accounting: MACs / memory per attention layer, and a model's cost (with its
parameter counts, moeify.models.params).

MACs and memory use the formulas that printed the SwitchHead paper's tables (the authors' code;
they differ from the paper's Eq. 13). All quantities are per attention layer, per sequence,
batch 1. Symbols: d = d_model, H = heads, d_h = d_head, E = experts, k = active experts,
T = chunk length, C = 1 + memory chunks (2 with XL memory, 1 without).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.feedforward import DenseFFConfig
from moeify.layers.gqa import GroupedQueryAttentionConfig
from moeify.layers.moa import MoAConfig
from moeify.layers.moh import MoHConfig
from moeify.layers.mosa import MoSAConfig, tokens_kept
from moeify.layers.remoe import ReMoEConfig
from moeify.layers.switchhead import SwitchHeadConfig
from moeify.models.params import model_parameters
from moeify.ops.recursion_routing import recursion_count
from moeify.ops.routing import expert_choice_count

if TYPE_CHECKING:
    from moeify.models.config import ModelConfig

# The projections SwitchHead may turn into experts (SwitchHead Eq. 7-10).
PROJECTIONS = ("q", "k", "v", "o")


# --------------------------------------------------------------------------- formatting

def format_count(x: int | float) -> str:
    """The paper's print format: x/1e9 with one decimal and "G" above 1000M, else x/1e6 with one
    decimal and "M" (453,427,200 -> "453.4M", 762,880 -> "0.8M"); below 50,000, where that would
    print "0.0M", x/1e3 with one decimal and "K" (12,345 -> "12.3K")."""
    if x / 1e6 > 1000:
        return f"{x / 1e9:.1f}G"
    if abs(x) < 50_000:
        return f"{x / 1e3:.1f}K"
    return f"{x / 1e6:.1f}M"


# --------------------------------------------------------------------------- MACs / memory

@dataclass(frozen=True)
class AttentionCost:
    """MACs and memory (floats held) of one attention layer for one sequence of T tokens: what
    moeify's layer executes. ``activated_head_macs``: for MoH, what a kernel computing only each
    token's activated heads would execute (the paper's measure; ``moh_cost``), else None."""

    macs: int
    memory: int
    activated_head_macs: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"macs": self.macs, "memory": self.memory,
               "macs_str": format_count(self.macs), "memory_str": format_count(self.memory)}
        if self.activated_head_macs is not None:
            out["activated_head_macs"] = self.activated_head_macs
            out["activated_head_macs_str"] = format_count(self.activated_head_macs)
        return out


def _positive(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def dense_attention_cost(*, d_model: int, n_heads: int, d_head: int, T: int, C: int,
                         xl: bool) -> AttentionCost:
    """Dense multi-head attention. XL adds the relative-position projection and its product with
    the queries (the 2·H·d·T·d_h·C terms); RoPE / no positional encoding have neither."""
    _positive(d_model=d_model, n_heads=n_heads, d_head=d_head, T=T, C=C)
    d, H, dh = d_model, n_heads, d_head
    macs = 2 * H * dh * C * T * T + 4 * d * H * dh * T
    mem = 2 * H * C * T * T + 4 * H * dh * T
    if xl:
        macs += 2 * H * d * T * dh * C
        mem += 2 * H * T * dh * C
    return AttentionCost(macs, mem)


def switchhead_cost(*, d_model: int, n_heads: int, d_head: int, n_experts: int, k: int, T: int,
                    C: int, experts: frozenset[str] | tuple[str, ...] = ("v", "o"), xl: bool,
                    shared_selection: bool = False) -> AttentionCost:
    """SwitchHead (module docstring): n_exp expert projections among Q, K, V, O cost k matmuls each,
    the dense ones one each; n_sels selection matrices are evaluated over the C·T source tokens.

    ``shared_selection`` (one W_S for V and O) counts a single selection; the paper's cost
    formula has no term for this variant, so this is our accounting of it."""
    _positive(d_model=d_model, n_heads=n_heads, d_head=d_head, n_experts=n_experts, k=k, T=T,
              C=C)
    exp = set(experts)
    if not exp <= set(PROJECTIONS):
        raise ValueError(f"experts must be a subset of {PROJECTIONS}, got {sorted(exp)}")
    d, H, dh, E = d_model, n_heads, d_head, n_experts
    n_exp = len(exp)
    n_proj = n_exp * k + 4 - n_exp
    n_sels = min(1, ("k" in exp) + ("v" in exp)) + min(1, ("q" in exp) + ("o" in exp))
    if shared_selection:
        n_sels = min(n_sels, 1)
    macs = 2 * H * dh * C * T * T + n_proj * d * H * dh * T + n_exp * H * k * T * dh \
        + n_sels * E * d * T * C
    mem = 2 * H * C * T * T + 4 * H * dh * T + n_sels * E * T * C
    if xl:
        macs += 2 * H * d * T * dh
        mem += 2 * H * T * dh
    return AttentionCost(macs, mem)


def moa_cost(*, d_model: int, n_heads: int, d_head: int, n_experts: int, T: int, C: int,
             xl: bool, k_term: int = 2) -> AttentionCost:
    """MoA (module docstring) with H = the number of selected heads (MoA's top-k).

    ``k_term`` is the k of the H·k·T·d_h term: 2 in every MoA row the SwitchHead paper printed
    (the authors' accounting read it from an unrelated setting); with it, d_h = 88 and E = 10
    reproduce Table 1 (140.1M / 223.5M / 306.8M / 390.2M MACs for H = 2, 4, 6, 8).
    The position-projection term 2·d·T·d_h·C applies to XL only."""
    _positive(d_model=d_model, n_heads=n_heads, d_head=d_head, n_experts=n_experts, T=T, C=C,
              k_term=k_term)
    d, H, dh, E = d_model, n_heads, d_head, n_experts
    macs = 2 * H * dh * C * T * T + (2 * H + 2) * d * dh * T + H * k_term * T * dh + E * d * T
    mem = 2 * H * C * T * T + (2 * H + 2) * dh * T + 2 * T * dh + E * T * C
    if xl:
        macs += 2 * d * T * dh * C
    return AttentionCost(macs, mem)


def gqa_cost(*, d_model: int, n_heads: int, n_kv_heads: int, d_head: int, T: int,
             C: int) -> AttentionCost:
    """Grouped-query attention, in the terms of ``dense_attention_cost``: the Q and O
    projections cost d·H·d_h per token, K and V d·Hk·d_h; the cache holds Hk key/value heads
    (biases and RoPE are not counted, as in the dense formula)."""
    _positive(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head, T=T, C=C)
    d, H, Hk, dh = d_model, n_heads, n_kv_heads, d_head
    macs = 2 * H * dh * C * T * T + 2 * d * (H + Hk) * dh * T
    mem = 2 * H * C * T * T + 2 * (H + Hk) * dh * T
    return AttentionCost(macs, mem)


def mosa_cost(*, d_model: int, n_heads: int, d_head: int, k: int, T: int,
              n_dense_heads: int = 0, n_local_heads: int = 0,
              local_window: int = 0) -> AttentionCost:
    """MoSA (arXiv 2505.00315), in the terms of ``dense_attention_cost``: per sparse head the
    router over all T tokens (d·T), the Q, K, V and O projections of its k selected tokens
    (4·d·h'·k) and the attention among them (2·h'·k²): O(k² + T) per head. Memory: the k×k
    attention twice, the four k×h' projections and the T router scores. The hybrid's dense heads
    add ``dense_attention_cost`` (RoPE, no memory). The long-sequence hybrid's local heads (window
    w) each project all T tokens (4·d·h'·T) and, blocked as they run, score every query against
    the 2w keys of its block and the one before (2·h'·T·2w, masked keys included); memory the
    T×2w scores twice and the four T×h' projections. Our accounting: the paper prints no formula
    in this form."""
    _positive(d_model=d_model, n_heads=n_heads, d_head=d_head, k=k, T=T)
    d, H, dh = d_model, n_heads, d_head
    macs = H * (d * T + 4 * d * dh * k + 2 * dh * k * k)
    mem = H * (2 * k * k + 4 * dh * k + T)
    if n_dense_heads:
        dense = dense_attention_cost(d_model=d, n_heads=n_dense_heads, d_head=dh, T=T, C=1,
                                     xl=False)
        macs, mem = macs + dense.macs, mem + dense.memory
    if n_local_heads:
        w2 = 2 * local_window
        macs += n_local_heads * (4 * d * dh * T + 2 * dh * T * w2)
        mem += n_local_heads * (2 * T * w2 + 4 * dh * T)
    return AttentionCost(macs, mem)


def moh_cost(cfg: MoHConfig, *, T: int, C: int) -> AttentionCost:
    """MoH (arXiv 2410.11842; moeify.layers.moh), in the terms of ``gqa_cost``. moeify's layer
    computes every head, as the authors' code does, so its MACs and memory are those of
    grouped-query attention with H heads (Hk key/value heads; XL adds the dense layer's
    position term 2·H·d·T·d_h·C) plus, per token, the routers (W_r, W_s, W_h: (R + h_s + 2)·d
    when all exist; the query-norm router R·d_h, the query norms) and the gates (H·d_h, every
    head's output times its gate); memory adds the router scores (R + h_s + 2, or R, per
    token).

    ``activated_head_macs`` counts what a kernel computing only the A = h_s + K heads each
    token activates would execute, the paper's measure (its Table 7 times such a sparse
    matrix multiplication): the Q and O projections (2·d·A·d_h per token), the attention
    (2·A·d_h·C·T per token) and XL's position term of those A heads, every head's K and V
    (2·d·Hk·d_h: a later token may activate any head), the routers, and the A gates (A·d_h).
    Our accounting: the paper prints no MAC formula."""
    d, H, Hk, dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.d_head
    _positive(d_model=d, n_heads=H, d_head=dh, T=T, C=C)
    shapes = cfg.router_shapes()
    rows = sum(r for r, _ in shapes.values())
    router = rows * d if cfg.router == "learned" else cfg.n_routed * dh

    def heads(n: int) -> tuple[int, int]:
        """MACs and memory with n query heads computed (gqa_cost, XL, routers, gates)."""
        base = gqa_cost(d_model=d, n_heads=n, n_kv_heads=Hk, d_head=dh, T=T, C=C)
        macs, mem = base.macs + router * T + n * dh * T, base.memory + (rows or cfg.n_routed) * T
        if cfg.pos == "xl":
            macs, mem = macs + 2 * n * d * T * dh * C, mem + 2 * n * T * dh * C
        return macs, mem

    macs, mem = heads(H)
    return AttentionCost(macs, mem, activated_head_macs=heads(cfg.active_heads)[0])


def mosa_paper_flops(*, n_layers: int, d_model: int, d_head: int, T: int, n_dense_heads: int,
                     n_mosa_heads: int = 0, k: int = 1, d_ff: int | None = None) -> int:
    """The forward-pass FLOPs of a model as MoSA's paper counts them (arXiv 2505.00315, Sec. 3.2
    "FLOPs Calculation" and App. A), the count its IsoFLOP comparisons hold fixed:

        l·H_dense·(8hh'T + 4h'T²) + l·H_mosa·(8hh'k + 4h'k² + 2hT + h'k) + 16·l·h²·T

    per dense head the Q, K, V, O projections (8hh'T) and the attention (4h'T²); per MoSA head
    the same over its k tokens plus the routing overhead (2hT scoring every token, h'k scaling
    the outputs by the scores); the feedforward 16h²T per layer (d_ff = 4h; a given ``d_ff``
    counts 4·h·d_ff·T, the same term). A matmul [i, j]·[j, k] counts 2ijk; layer norms,
    residuals and embeddings are left out, as the paper does. l = ``n_layers``, h =
    ``d_model``, h' = ``d_head``. These are FLOPs (2 per multiply-add), not the MACs of
    ``mosa_cost``, and cover the whole model, not one attention layer."""
    _positive(n_layers=n_layers, d_model=d_model, d_head=d_head, T=T, k=k)
    for name, v in (("n_dense_heads", n_dense_heads), ("n_mosa_heads", n_mosa_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
    h, hp = d_model, d_head
    ff = 16 * h * h * T if d_ff is None else 4 * h * d_ff * T
    return n_layers * (n_dense_heads * (8 * h * hp * T + 4 * hp * T * T)
                       + n_mosa_heads * (8 * h * hp * k + 4 * hp * k * k + 2 * h * T + hp * k)
                       + ff)


def mosa_isoflop_heads(*, n_layers: int, d_model: int, d_head: int, T: int,
                       baseline_heads: int, sparsity: int, n_dense_heads: int) -> int:
    """The number of MoSA heads of an IsoFLOP row of MoSA's paper (Sec. 3.2; Table 5's caption,
    App. A): the largest H_mosa whose model, with ``n_dense_heads`` dense heads kept (4 in the
    hybrid, 0 in pure MoSA) and k = T / ρ tokens per head, does not exceed the FLOPs
    (``mosa_paper_flops``) of the dense baseline of ``baseline_heads`` heads, all else equal.
    k counts the always-included first token (the IsoFLOP rows select k - 1 tokens and the
    first) and is the layer's (``tokens_kept``: T // ρ, which is T / ρ for the paper's T = 1024
    and ρ a power of 2, at least 2 and at most T)."""
    _positive(baseline_heads=baseline_heads, sparsity=sparsity)
    if n_dense_heads > baseline_heads:
        raise ValueError(f"n_dense_heads={n_dense_heads} exceeds the baseline's "
                         f"{baseline_heads} heads")
    shape = dict(n_layers=n_layers, d_model=d_model, d_head=d_head, T=T)
    k = tokens_kept(T, sparsity)
    budget = mosa_paper_flops(**shape, n_dense_heads=baseline_heads)
    fixed = mosa_paper_flops(**shape, n_dense_heads=n_dense_heads)
    per_head = mosa_paper_flops(**shape, n_dense_heads=0, n_mosa_heads=1, k=k) \
        - mosa_paper_flops(**shape, n_dense_heads=0)
    return (budget - fixed) // per_head


def model_paper_flops(config: "ModelConfig") -> int | None:
    """``mosa_paper_flops`` of a ModelConfig whose every layer the paper's formula covers: MoSA
    or dense attention without XL memory (all of the same head width), a dense feedforward, no
    depth routing, no layer sharing; None for any other model. Layers are summed one by one,
    with the k each MoSA layer keeps (``tokens_kept``: T // ρ, the paper's k, at least 2 and at
    most T, as Sec. 3.5 and the layer have it). None with local heads (the long-sequence
    hybrid): the formula has no term for them."""
    if config.xl_memory or config.group_size or config.recursion is not None or any(
            x is not None for x in config.depth_layers()):
        return None
    T, total = config.context_length, 0
    for attn, ff in zip(config.attention_layers(), config.feedforward_layers()):
        if not isinstance(ff, DenseFFConfig):
            return None
        one = dict(n_layers=1, d_model=config.d_model, T=T, d_ff=ff.d_ff)
        if isinstance(attn, MoSAConfig) and attn.n_local_heads:
            return None
        if isinstance(attn, MoSAConfig):
            total += mosa_paper_flops(**one, d_head=attn.d_head, n_dense_heads=attn.n_dense_heads,
                                      n_mosa_heads=attn.n_heads, k=attn.tokens_kept(T))
        elif isinstance(attn, DenseAttentionConfig) and attn.pos != "xl":
            total += mosa_paper_flops(**one, d_head=attn.d_head, n_dense_heads=attn.n_heads)
        else:
            return None
    return total


def shared_kv_attention_cost(cfg: Any, *, queries: int, keys: int) -> AttentionCost:
    """One application of an attention layer that reuses the keys and values an earlier
    application computed (Mixture-of-Recursions' recursive KV sharing, arXiv 2507.10524
    Sec. 2.2.2), in the terms of ``dense_attention_cost``: the Q and O projections of its
    ``queries`` tokens (2·d·H·d_h each), their attention over ``keys`` cached tokens
    (2·H·d_h·queries·keys) and no K or V projection; memory the queries × keys logits twice and
    the Q and O activations. XL (dense attention) adds its position projection over the keys'
    distances (2·H·d·keys·d_h). Grouped-query attention reads Hk key/value heads but its
    queries have H, as the formula counts. Our accounting: the paper prints none. Dense and
    grouped-query attention only (the paper's models are Llama); ValueError for the others."""
    _positive(queries=queries, keys=keys)
    if not isinstance(cfg, (DenseAttentionConfig, GroupedQueryAttentionConfig)):
        raise ValueError(f"no cost formula for recursive KV sharing with "
                         f"{type(cfg).__name__}; supported: DenseAttentionConfig, "
                         "GroupedQueryAttentionConfig")
    d, H, dh = cfg.d_model, cfg.n_heads, cfg.d_head
    macs = 2 * H * dh * queries * keys + 2 * d * H * dh * queries
    mem = 2 * H * queries * keys + 2 * H * dh * queries
    if cfg.pos == "xl":
        macs += 2 * H * d * keys * dh
        mem += 2 * H * keys * dh
    return AttentionCost(macs, mem)


def attention_cost(cfg: Any, *, T: int, C: int) -> AttentionCost:
    """Dispatch on an attention config (DenseAttentionConfig, SwitchHeadConfig, MoAConfig,
    GroupedQueryAttentionConfig, MoSAConfig, MoHConfig)."""
    if isinstance(cfg, MoSAConfig):
        return mosa_cost(d_model=cfg.d_model, n_heads=cfg.n_heads, d_head=cfg.d_head,
                         k=cfg.tokens_kept(T), T=T, n_dense_heads=cfg.n_dense_heads,
                         n_local_heads=cfg.n_local_heads, local_window=cfg.local_window)
    if isinstance(cfg, MoHConfig):
        return moh_cost(cfg, T=T, C=C)
    if isinstance(cfg, GroupedQueryAttentionConfig):
        return gqa_cost(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                        d_head=cfg.d_head, T=T, C=C)
    xl = cfg.pos == "xl"
    if isinstance(cfg, DenseAttentionConfig):
        return dense_attention_cost(d_model=cfg.d_model, n_heads=cfg.n_heads,
                                    d_head=cfg.d_head, T=T, C=C, xl=xl)
    if isinstance(cfg, SwitchHeadConfig):
        return switchhead_cost(d_model=cfg.d_model, n_heads=cfg.n_heads, d_head=cfg.d_head,
                               n_experts=cfg.n_experts, k=cfg.k, T=T, C=C,
                               experts=cfg.experts, xl=xl,
                               shared_selection=cfg.shared_selection)
    if isinstance(cfg, MoAConfig):
        return moa_cost(d_model=cfg.d_model, n_heads=cfg.k, d_head=cfg.d_head,
                        n_experts=cfg.n_experts, T=T, C=C, xl=xl)
    raise ValueError(f"no cost formula for attention config {type(cfg).__name__}; "
                     "supported: DenseAttentionConfig, SwitchHeadConfig, MoAConfig, "
                     "GroupedQueryAttentionConfig, MoSAConfig, MoHConfig")


@dataclass
class ModelCost:
    """Parameter counts and per-attention-layer costs of a ModelConfig."""

    params: int
    params_by_part: dict[str, int]
    T: int
    C: int
    layers: list[dict[str, Any]] = field(default_factory=list)
    # a model with MoSA layers: its forward-pass FLOPs as MoSA's paper counts them
    # (``model_paper_flops``), the budget of the paper's IsoFLOP rows; None otherwise
    mosa_paper_flops: int | None = None
    # ReMoE feedforwards (``remoe_feedforward_cost``), one entry per distinct config
    remoe: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = {"params": self.params, "params_str": format_count(self.params),
               "params_by_part": dict(self.params_by_part), "T": self.T, "C": self.C,
               "layers": [dict(x) for x in self.layers]}
        if self.mosa_paper_flops is not None:
            out["mosa_paper_flops"] = self.mosa_paper_flops
        if self.remoe:
            out["remoe"] = [dict(x) for x in self.remoe]
        return out


def remoe_feedforward_cost(cfg: ReMoEConfig, experts_per_token: float | None = None,
                           ) -> dict[str, Any]:
    """A ReMoE feedforward's MACs per token: the router's E · D plus, per active expert,
    (3 if gated else 2) · D · G. ReLU routing gives each token a variable number of experts, so
    the cost depends on the measured sparsity: ``experts_per_token`` (the layer's
    ``experts_per_token`` statistic, logged in training) or, when None, the target k."""
    per_expert = (3 if cfg.gated else 2) * cfg.d_model * cfg.expert_size
    router = cfg.n_experts * cfg.d_model
    k = cfg.k if experts_per_token is None else experts_per_token
    return {"router_macs": router, "macs_per_active_expert": per_expert, "experts_per_token": k,
            "macs_per_token": router + k * per_expert, "measured": experts_per_token is not None}


def attention_summary(cfg: Any) -> str:
    """A short description of an attention config: "SwitchHead H=2 d_h=76 E=5 k=2 VO xl"."""
    name = type(cfg).__name__.removesuffix("Config").removesuffix("Attention") or "Dense"
    if name == "GroupedQuery":
        return f"GQA H={cfg.n_heads} Hk={cfg.n_kv_heads} d_h={cfg.d_head} {cfg.pos}"
    if name == "MoSA":
        local = (f" +{cfg.n_local_heads} local w={cfg.local_window}" if cfg.n_local_heads
                 else "")
        return (f"MoSA H={cfg.n_heads} d_h={cfg.d_head} rho={cfg.sparsity} "
                f"+{cfg.n_dense_heads} dense{local} {cfg.pos}")
    if name == "MoH":
        return (f"MoH H={cfg.n_heads} d_h={cfg.d_head} shared={cfg.n_shared} "
                f"k={cfg.k}/{cfg.n_routed}"
                + ("" if cfg.router == "learned" else f" {cfg.router}") + f" {cfg.pos}")
    parts = [name]
    if hasattr(cfg, "n_experts") and name == "MoA":
        parts += [f"H={cfg.k}/{cfg.n_experts}", f"d_h={cfg.d_head}"]
    else:
        parts += [f"H={cfg.n_heads}", f"d_h={cfg.d_head}"]
        if hasattr(cfg, "n_experts"):
            parts += [f"E={cfg.n_experts}", f"k={cfg.k}",
                      "".join(p for p in "qkvo" if p in cfg.experts).upper()]
            if getattr(cfg, "shared_selection", False):
                parts.append("shared")
    return " ".join(parts + [cfg.pos])


def _recursion_rows(config: "ModelConfig", T: int, C: int) -> list[dict[str, Any]]:
    """``model_cost``'s rows of a Mixture-of-Recursions model, in the order they run."""
    mor = config.recursion
    attns = config.attention_layers()
    start, size = mor.stack_layers(config.n_layers)
    plan = [(attns[0], T, None)] if start else []
    for r, beta in enumerate(mor.betas):
        tokens = recursion_count(T, beta) if mor.routing == "expert" else T
        if mor.kv_sharing and r == 0:
            tokens = T  # the first step runs every token: the keys and values every step reads
        plan += [(a, tokens, r) for a in attns[start:start + size]]
    if start:
        plan.append((attns[-1], T, None))
    rows = []
    for i, (attn, tokens, r) in enumerate(plan):
        row = {"layer": i, "attention": attention_summary(attn), "tokens": tokens}
        if r is not None:
            row["recursion"] = r
        if mor.kv_sharing and r:
            row["kv_shared"] = True
            cost = shared_kv_attention_cost(attn, queries=tokens, keys=T)
        else:
            cost = attention_cost(attn, T=tokens, C=C)
        rows.append({**row, **cost.to_dict()})
    return rows


def model_cost(config: "ModelConfig") -> ModelCost:
    """Total parameters and, per attention layer, MACs and memory (module docstring).

    A block under Mixture-of-Depths runs its attention only on the ceil(capacity · T) tokens it
    routes (they attend only to each other), so its row uses that token count; this extends the
    paper's formulas, which have no depth routing.

    With Mixture-of-Recursions there is one row per application of an attention layer: the
    unshared ones, then the shared stack at each recursion step r ("recursion": r), whose
    expert-choice step runs floor(beta_r · T) tokens (at least 1) that attend only to each
    other; a token-choice step is counted at T tokens, its upper bound (the depths are learned).
    With recursive KV sharing the first step runs all T tokens and every later step's rows
    ("kv_shared": True) count its queries over the first step's T keys, without K and V
    projections (``shared_kv_attention_cost``)."""
    T = config.context_length
    C = 2 if config.xl_memory else 1
    parts = model_parameters(config)
    layers = []
    if config.recursion is not None:
        layers = _recursion_rows(config, T, C)
    for i, (attn, depth) in enumerate(zip(config.attention_layers(), config.depth_layers())):
        if config.recursion is not None:
            break
        tokens = T if depth is None else expert_choice_count(T, depth.capacity)
        c = attention_cost(attn, T=tokens, C=C)
        layers.append({"layer": i, "attention": attention_summary(attn), "tokens": tokens,
                       **c.to_dict()})
    flops = None
    if any(isinstance(a, MoSAConfig) for a in config.attention_layers()):
        flops = model_paper_flops(config)
    remoe = []
    for ff in config.feedforward_layers():
        if isinstance(ff, ReMoEConfig):
            row = remoe_feedforward_cost(ff)
            if row not in remoe:
                remoe.append(row)
    return ModelCost(params=parts.pop("total"), params_by_part=parts, T=T, C=C, layers=layers,
                     mosa_paper_flops=flops, remoe=remoe)
