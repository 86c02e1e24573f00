"""MoH, Mixture-of-Head attention (Jin, Zhu, Yuan, Yan, ICML 2025, arXiv 2410.11842v3, Sec. 3).

Multi-head attention written as a sum over heads (Sec. 3.1, Eq. 3: MultiHead(X, X') =
Σ_i H^i W_O^i, H^i the i-th head's attention output, W_O^i its rows of W_O) becomes a weighted
sum in which each token activates only some heads (Sec. 3.2, "Mixture-of-Head Attention"):

    MoH(X, X') = Σ_i g_i H^i W_O^i                                   Eq. 4 (per token x_t)

The first h_s heads are *shared* (always active); of the other h - h_s *routed* heads each token
keeps the Top-K. Two-stage routing, per token x_t:

    g_i = α1 · Softmax(W_s x_t)_i          1 <= i <= h_s             Eq. 5, shared heads
    g_i = α2 · Softmax(W_r x_t)_{i-h_s}    if (W_r x_t)_{i-h_s} ∈ Top-K (routed heads)
    g_i = 0                                otherwise
    [α1, α2] = Softmax(W_h x_t)                                      Eq. 6, W_h: [2, d_in]

and the load-balance loss over the routed heads (Eq. 7), added to the task loss with weight β
(Eq. 8: L = L_task + β L_b, β = 0.01 for all tasks):

    L_b = Σ_{i=h_s+1}^{h} P_i f_i,   f_i = (1/T) Σ_t 1(x_t selects head i),
                                     P_i = (1/T) Σ_t Softmax(W_r x_t)_{i-h_s}

``weights="authors"`` (the default) computes the gates as the authors' code does
(SkyworkAI/MoH, MoH-ViT/attention.py and MoH-DiT/models.py ``MoHAttention``): the kept routed
probabilities are renormalised to sum to 1 over the Top-K and multiplied by K, the shared
softmax is multiplied by h_s and [α1, α2] by 2 (with h_s = 1 the shared gate is α1 times 1, no
W_s, as their ViT code). Each factor makes a uniform router give every active head the gate 1,
the unweighted sum of multi-head attention: so a zero router reproduces multi-head attention
exactly when every head is active (what ``moeify upcycle`` relies on). ``weights="paper"``
is Eqs. 5-6 as printed (no renormalisation, no factors). Without shared heads g = the routed
gates (no W_h); with no routed heads (K = 0, h_s = h) g = the shared gates (their code's
"routed_head = 0" branch). The balance loss is the authors' ``E · Σ f_i P_i`` with E = h - h_s
routed heads (Switch Transformer's N·Σ f P; f_i sums to K over the routed heads), averaged over
the valid (non-padding) tokens, present whenever ``balance_coef`` and a routed head exist (the
authors' code adds it in training mode only).

``router="query_norm"`` is the router of the paper's continue-tuned LLaMA3-8B (Sec. 4.4: the
first 16 of each layer's 32 heads shared, a parameter-free router from the ℓ2 norm of each
head's query) as the authors' MoH-LLaMA3 code computes it (MoH-LLaMA3/Inference_code/
modeling_llama.py): routed head i scores ‖q_t,i‖ (its query before RoPE) divided by the standard
deviation (unbiased) of those norms over the routed heads, Softmax, Top-K, and the gates are
quantised: 1 for the shared and the selected heads, 0 otherwise (Eq. 9; no weighted sum). The
balance loss uses those softmax probabilities. As the paper trains (Eq. 10, a straight-through
estimator), a selected head's gate passes its gradient on to the real-valued score, the head's
softmax probability: the forward value is exactly 1, ``1 + (p - p.detach())``. The released
inference code's gates are constant, which gives the same outputs.

Everything else is multi-head attention as moeify's dense layer computes it: Q for every head,
K and V for ``n_kv_heads`` heads (grouped-query attention when fewer, as LLaMA3), optional
biases (imported checkpoints), positions / masks / cache / dropout in the attention core
(moeify.layers.attention_core), W_O of every head applied to the gated head outputs. Every head
is computed for every token, as in the authors' code: the gates zero the inactive heads'
outputs, so the layer executes the dense layer's MACs plus the routers' and the gates', which is
what moeify.models.cost counts as its MACs. The paper's inference speed-up (Table 7) comes from
a sparse matrix multiplication over the activated heads only; the cost reports those
activated-head MACs as a separate figure.

Decoding: the routing of token t depends on x_t alone, and every head's key and value is cached
for every token, so cached decoding equals the full forward pass.

Weight mapping to the authors' ``MoHAttention(dim, num_heads, qkv_bias, shared_head=h_s,
routed_head=K, head_dim=C)`` (their ``qkv`` is one nn.Linear with output [3, H, C]):
    w_q, w_k, w_v [D, H·C]     qkv.weight[j·H·C:(j+1)·H·C].T for j = 0, 1, 2 (biases likewise)
    w_o [H·C, D], bias_o [D]   proj.weight.T, proj.bias (``out_bias``; theirs always has one)
    w_router [h - h_s, D]      wg.weight (W_r)
    w_router_shared [h_s, D]   wg_1.weight (W_s; only for h_s > 1)
    w_router_type [2, D]       wg_0.weight (W_h; only with shared and routed heads)
Their attention is bidirectional with no positions (ViT / DiT): moeify's ``pos="none"`` with
``causal=False`` computes the same. To their MoH-LLaMA3 ``LlamaAttention`` (h_s = h/2, K = h/4):
w_q, w_k, w_v, w_o = q_proj.weight.T, k_proj.weight.T, v_proj.weight.T, o_proj.weight.T with
``router="query_norm"``, ``n_kv_heads`` = num_key_value_heads, ``rope_fraction=1.0``.
tests/layers/test_moh.py holds the layer to an independent transcription of Eqs. 4-7 and 9
(tests/references.py ``ref_moh``) in float64, outputs and gradients.

Deviations: (1) initialisation: every head as moeify's dense layer (trunc-normal, std
s/sqrt(fan_in), s = sqrt(2/L)), routers N(0, s²/d); the authors' routers take their model's
Linear init (xavier-uniform in DiT, trunc-normal 0.02 in ViT). (2) Router probabilities are
softmaxes in float32 (float64 for float64 inputs) of logits in the input's precision (float32
under autocast), as moeify's other routers. (3) Top-K ties go to the lowest head index
(moeify.ops.routing.top_indices); torch.topk leaves them unspecified. (4) The balance loss
leaves padding out.

Shape legend: B batch, T query tokens, S source tokens, D d_model, H heads (h), Hk key/value
heads, C d_head, R routed heads (h - h_s), K routed heads kept per token, M = B·T tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeify.layers.attention import (
    HeadAttention,
    check_inputs,
    core_config,
    destination_validity,
    head_projection_params,
)
from moeify.layers.attention_core import check_core_fields, check_kv_heads
from moeify.layers.common import (
    Aux,
    accumulate_usage,
    check_count,
    check_flag,
    check_nonnegative,
    check_positive,
    init_scale,
    register_usage,
    routing_record,
)
from moeify.ops.aux_losses import router_entropy, topk_balance_loss
from moeify.ops.routing import selection_logits, top_indices

MOH_POSITIONAL = ("xl", "rope", "none", "absolute")
ROUTERS = ("learned", "query_norm")
WEIGHTS = ("authors", "paper")


@dataclass(frozen=True, kw_only=True)
class MoHConfig:
    """MoH attention: ``n_heads`` heads of width ``d_head``, the first ``n_shared`` always
    active, ``k`` of the other n_heads - n_shared chosen per token (module docstring).

    router:       "learned" (Eqs. 5-6, W_r / W_s / W_h) or "query_norm" (the authors' LLaMA3
                  conversion: routed heads scored by their query norms, binary gates).
    weights:      "authors" (their code's renormalised and rescaled gates) or "paper" (Eqs.
                  5-6 as printed); learned router only.
    balance_coef: β of the load-balance loss (Eq. 8; 0.01 for all the paper's tasks).
    n_kv_heads:   key/value heads (None: n_heads); fewer is grouped-query attention.
    qkv_bias / out_bias: biases of the Q, K, V projections / of the output projection.
    pos:          "rope", "xl", "none" or "absolute" (the model's learned positions).
    n_layers:     model depth L for the init scale s = sqrt(2 / L).
    """

    d_model: int
    n_heads: int
    d_head: int
    n_shared: int
    k: int
    router: str = "learned"
    weights: str = "authors"
    balance_coef: float = 0.01
    n_kv_heads: int | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    pos: str = "rope"
    n_layers: int = 1
    attn_dropout: float = 0.0
    rope_fraction: float = 0.5
    rope_base: float = 10000.0
    attn_impl: str = "auto"

    def __post_init__(self) -> None:
        check_positive(self, "d_model", "n_heads", "d_head", "n_layers")
        check_core_fields(self, MOH_POSITIONAL)
        check_count(self, "n_shared", "k")
        H, hs, K = self.n_heads, self.n_shared, self.k
        if hs > H:
            raise ValueError(f"MoHConfig.n_shared={hs} exceeds n_heads={H}")
        R = H - hs
        if R and not 1 <= K <= R:
            raise ValueError(f"MoHConfig.k must lie in [1, {R}] (the routed heads, n_heads - "
                             f"n_shared), got {K}")
        if not R and K:
            raise ValueError(f"MoHConfig.k must be 0 when every head is shared (n_shared = "
                             f"n_heads), got {K}")
        if self.router not in ROUTERS:
            raise ValueError(f"MoHConfig.router must be one of {', '.join(ROUTERS)}, "
                             f"got {self.router!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"MoHConfig.weights must be one of {', '.join(WEIGHTS)}, "
                             f"got {self.weights!r}")
        if self.router == "query_norm" and R < 2:
            raise ValueError("MoHConfig: router='query_norm' scores the routed heads by their "
                             "query norms over the norms' spread: it needs at least 2 routed "
                             "heads (n_heads - n_shared >= 2)")
        check_nonnegative(self, "balance_coef")
        check_kv_heads(self)
        check_flag(self, "qkv_bias", "out_bias")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def n_routed(self) -> int:
        """R = h - h_s, the heads the router chooses among."""
        return self.n_heads - self.n_shared

    @property
    def active_heads(self) -> int:
        """Heads each token activates: h_s + K."""
        return self.n_shared + self.k

    def router_shapes(self) -> dict[str, tuple[int, int]]:
        """The router Parameters and their shapes: W_r, W_s (h_s > 1) and W_h (both kinds)."""
        if self.router != "learned":
            return {}
        D, hs, R = self.d_model, self.n_shared, self.n_routed
        out = {}
        if R:
            out["w_router"] = (R, D)
        if hs > 1:
            out["w_router_shared"] = (hs, D)
        if hs and R:
            out["w_router_type"] = (2, D)
        return out

    def param_count(self) -> int:
        """Q and O: d·H·d_h each; K and V: d·Hk·d_h each; the biases; the routers; XL adds the
        dense layer's position projection, u, v and scale (the core's)."""
        H, Hk = self.n_heads, self.kv_heads
        n = head_projection_params(self.d_model, H, Hk, self.d_head, qkv_bias=self.qkv_bias,
                                   out_bias=self.out_bias)
        n += sum(a * b for a, b in self.router_shapes().values())
        return n + core_config(self, n_heads=H, n_kv_heads=Hk, xl_biases=True).param_count()

    def build(self) -> "MoHAttention":
        return MoHAttention(self)


class MoHAttention(HeadAttention):
    """The attention interface of every moeify attention (docs/interfaces.md); the heads'
    weights, their projections and the core are multi-head attention's (HeadAttention)."""

    def __init__(self, config: MoHConfig):
        c = config
        super().__init__(c, n_kv_heads=c.kv_heads, qkv_bias=c.qkv_bias, out_bias=c.out_bias,
                         extra=c.router_shapes())
        if c.n_routed:
            register_usage(self, "usage", (c.n_routed,))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Heads as the dense layer (``reset_heads``); routers N(0, s²/d) (module docstring,
        deviation 1)."""
        c = self.config
        self.reset_heads()
        for name in c.router_shapes():
            getattr(self, name).normal_(0.0, init_scale(c.n_layers) / math.sqrt(c.d_model))
        self.core.reset_parameters()

    # ------------------------------------------------------------------------------------------

    def _route(self, x_MD, q_BHTC):
        """The gates g [M, H] (float32, float64 for float64 inputs) and, with routed heads, the
        router probabilities probs_MR, the kept heads idx_MK and their gates gates_MK (Eqs. 5-6;
        the query-norm router's Eq. 9; module docstring for the two weightings)."""
        c = self.config
        hs, R, K = c.n_shared, c.n_routed, c.k
        M = x_MD.shape[0]
        authors = c.weights == "authors"
        # float32 at least (half-precision inputs are promoted; float64 stays float64)
        f = torch.promote_types(x_MD.dtype, torch.float32)
        probs_MR = idx_MK = gates_MK = None
        if R:
            if c.router == "query_norm":
                B, H, T, C = q_BHTC.shape
                norms_MR = q_BHTC[:, hs:].transpose(1, 2).reshape(M, R, C).to(f).norm(dim=-1)
                logits_MR = norms_MR / norms_MR.std(dim=-1, keepdim=True)
            else:
                logits_MR = selection_logits(x_MD, self.w_router)
            probs_MR = torch.softmax(logits_MR.to(f), dim=-1)
            idx_MK = top_indices(probs_MR.detach(), K)
            kept_MK = probs_MR.gather(-1, idx_MK)
            if c.router == "query_norm":
                # Eq. 9's quantised gates, exactly 1 forward; Eq. 10's straight-through gradient
                gates_MK = 1 + (kept_MK - kept_MK.detach())
            elif authors:
                # renormalised over the Top-K, times K (their clamp at eps kept)
                denom = kept_MK.sum(-1, keepdim=True).clamp_min(torch.finfo(kept_MK.dtype).eps)
                gates_MK = kept_MK / denom * K
            else:
                gates_MK = kept_MK
            g_routed_MR = torch.zeros_like(probs_MR).scatter(-1, idx_MK, gates_MK)
        if hs:
            if c.router == "learned" and hs > 1:
                g_shared_MS = torch.softmax(selection_logits(x_MD, self.w_router_shared).to(f),
                                            -1)
            else:
                g_shared_MS = torch.ones(M, hs, dtype=f, device=x_MD.device)
            if c.router == "learned" and authors:
                g_shared_MS = g_shared_MS * hs
        if not R:
            return g_shared_MS, None, None, None
        if not hs:
            return g_routed_MR, probs_MR, idx_MK, gates_MK
        if c.router == "learned":
            alpha_M2 = torch.softmax(selection_logits(x_MD, self.w_router_type).to(f), -1)
            if authors:
                alpha_M2 = alpha_M2 * 2
            g_shared_MS = g_shared_MS * alpha_M2[:, :1]
            g_routed_MR = g_routed_MR * alpha_M2[:, 1:]
            gates_MK = gates_MK * alpha_M2[:, 1:]
        return torch.cat([g_shared_MS, g_routed_MR], -1), probs_MR, idx_MK, gates_MK

    def forward(self, q_BTD, kv_BSD=None, *, causal=True, cache=None, pos_q=None, pos_k=None,
                valid_k=None):
        """docs/interfaces.md. ``aux.losses["balance"]``: β·L_b (Eqs. 7-8; routed heads and a
        non-zero coefficient); ``aux.routing["router"]``: the kept routed heads, counts [1, h - h_s]
        (valid tokens only; also added to the ``usage`` buffer in training mode);
        ``aux.stats["router_entropy"]``."""
        c = self.config
        check_inputs(q_BTD, kv_BSD, c.d_model)
        B, T, D = q_BTD.shape
        q, k, v = self._qkv(q_BTD, kv_BSD)
        g_MH, probs_MR, idx_MK, gates_MK = self._route(q_BTD.reshape(B * T, D), q)
        o_BHTC = self.core(q, k, v, causal=causal, self_attention=kv_BSD is None, cache=cache,
                           pos_q=pos_q, pos_k=pos_k, valid_k=valid_k)
        # Eq. 4: each head's output weighted by its gate, then Σ_i (g_i H^i) W_O^i
        g_BHT1 = g_MH.view(B, T, c.n_heads).transpose(1, 2)[..., None].to(o_BHTC.dtype)
        y_BTD = (o_BHTC * g_BHT1).transpose(1, 2).reshape(B, T, -1) @ self.w_o
        if c.out_bias:
            y_BTD = y_BTD + self.bias_o
        aux = Aux()
        if probs_MR is None:
            return y_BTD, aux
        valid_BT = destination_validity(valid_k, kv_BSD, T, causal)
        valid_M = None if valid_BT is None else valid_BT.reshape(B * T)
        if c.balance_coef:
            aux.losses["balance"] = c.balance_coef * topk_balance_loss(probs_MR, idx_MK, valid_M)
        keep = None if valid_M is None else valid_M[:, None]
        aux.routing["router"] = record = routing_record("moh", idx_MK, c.n_routed, gates_MK, keep)
        aux.stats["router_entropy"] = router_entropy(probs_MR, valid_M).detach()
        accumulate_usage(self, "usage", record)
        return y_BTD, aux

    @torch.no_grad()
    def inspect(self, q_BTD, kv_BSD=None, *, causal=True, pos_q=None, pos_k=None, valid_k=None):
        """For analysis: ``probs_BHTS``, every head's attention probabilities (forward-pass
        code, no cache, no dropout), and ``sel_dst_BTHE`` [B, T, H, 1], each head's gate g_i at
        each token (0: inactive)."""
        c = self.config
        check_inputs(q_BTD, kv_BSD, c.d_model)
        B, T, D = q_BTD.shape
        q, k, _ = self._qkv(q_BTD, kv_BSD)
        g_MH = self._route(q_BTD.reshape(B * T, D), q)[0]
        probs = self.core.probs(q, k, causal=causal, self_attention=kv_BSD is None, pos_q=pos_q,
                                pos_k=pos_k, valid_k=valid_k)
        return {"probs_BHTS": probs, "sel_dst_BTHE": g_MH.view(B, T, c.n_heads, 1)}
