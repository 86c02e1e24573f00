"""Switch Transformer feedforward (Fedus, Zoph, Shazeer, JMLR 2022), with the router z-loss of
ST-MoE (Zoph et al. 2022) and the no-op experts of integrated MoDE (Raposo et al. 2024, §4).

Per token (Switch Transformer §2.1; ST-MoE for the router z-loss):

    p = softmax(W_r · x)                 float32 ("selective precision"), over E + Z outputs
    top-k of p (k = 1 in the paper)      choices ordered best first
    y = sum over kept choices i of  p_i · W_out,i · ReLU(W_in,i · x)      (T5-style, no biases)

(``bias`` and ``activation`` generalise the expert to W_out,i · act(W_in,i · x + b_i), plus an
ungated output bias: the form of a dense MLP with biases and another activation, for upcycling.)

The options of the Hugging Face MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), each an
exact form of the checkpoint's computation (moeify.interop.hf_import):

    gated        a SwiGLU expert, W_out,i · (act(W_gate,i · x) ⊙ W_in,i · x) (Shazeer 2020, Eq. 6)
    renormalize  the k kept gates divided by their sum (Mixtral always; the others when the
                 checkpoint's ``norm_topk_prob`` says so); without it they are the raw softmax
                 probabilities, as in Switch
    shared       an always-on dense expert added to every token (Qwen2-MoE's shared expert),
                 y += σ(w_sg · x) · shared(x) with ``shared_gate`` (its scalar sigmoid gate), or
                 y += shared(x) without (DeepSeekMoE; moeify.layers.shared_expert)

Balancing, besides the per-batch balance loss (moeify.ops.aux_losses):

    balance_scope="global"  the balance loss's f_i from the top-1 counts of the whole update
                 (all processes, every micro-batch: arXiv 2501.11873). The layer returns the
                 loss's parts (``Aux.balance``, a ``GlobalBalance``: the mean router
                 probabilities and this forward's top-1 counts); its loss from this forward's
                 counts alone is the per-batch loss, and the trainer takes it with the counts of
                 the whole update (moeify.train.balancing).
    lossfree_rate=gamma     loss-free balancing (arXiv 2408.15664): a buffer ``expert_bias``
                 [E + Z] is added to the softmax probabilities for the top-k choice only; the
                 trainer updates it after each optimizer step (moeify.train.balancing).

Capacity: each expert takes at most ceil(M · k / (E + Z) · capacity_factor) (token, choice) pairs
of the batch (M = B·T rows, padding included in M so that shapes stay static; padding itself
takes no capacity). Priority is by position: all first choices before any second choice, and
earlier tokens first within a choice rank (``moeify.ops.routing.capacity_mask``). A dropped
pair contributes zero; the residual carries the token. ``dropless=True`` keeps every pair.
Training uses ``capacity_factor``, evaluation ``eval_capacity_factor`` (Switch §2.2).

Decoding rule: capacity is computed per call, over that call's rows, so it depends on how many
tokens a call holds. A call with one token per sequence (T = 1: cached decoding, one new token
at a time) is dropless: no token competes with a later one of its own sequence, and a token's
output then does not depend on the other sequences of the batch. Cached decoding therefore
equals the full forward pass of the same weights with ``dropless=True``; it equals the capacity
model's full forward pass only where that pass drops nothing (the prompt, when fed as one chunk,
is routed with capacity like any call of several tokens).

Compute follows the capacity: the kept pairs are packed into a static-size buffer of
min(M·k, E·capacity) rows (kept pairs first, the rest padded with zero-gated rows), so the
expert matmuls never see more rows than the capacity allows and no host sync is needed.

Integrated MoDE (``noop_experts = Z > 0``): the router also scores Z no-op experts. A choice of a
no-op expert contributes zero (the token keeps only its residual) and costs no compute. Routing
choices, stated because no reference implementation exists: no-op experts are experts in every
respect but compute: they share the softmax, count in the capacity formula's E + Z (so the real
experts' capacity shrinks with Z), and take part in the balance and z-losses over all E + Z
outputs (the balance loss is what keeps the skip rate near Z / (E + Z)). In ``dropless`` mode the
no-op choices are carried through the expert matmul with a zero gate (static shapes).

Shape legend: B batch, T tokens, M = B·T rows, K choices per token, N = M·K routed pairs,
P packed pairs, D d_model, F d_ff per expert, E real experts, R = E + Z router outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeify.layers.common import (
    Aux,
    GlobalBalance,
    accumulate_usage,
    check_expert_impl,
    check_flag,
    check_nonnegative,
    check_positive,
    check_probability,
    check_token_input,
    register_usage,
    rename_legacy_keys,
    routing_record,
    trunc_normal_,
)
from moeify.layers.experts import EXPERT_KEYS, RoutedExperts
from moeify.layers.ff_common import check_activation, routing_stats
from moeify.layers.mlp import GatedMLPConfig, MLPConfig
from moeify.layers.shared_expert import add_shared, build_shared, check_shared, reset_shared_gate
from moeify.ops.aux_losses import mean_router_probs, switch_balance_loss, z_loss
from moeify.ops.routing import (capacity_mask, count_selections, expert_capacity,
                                router_logits, softmax_topk)

BALANCE_SCOPES = ("batch", "global")


@dataclass(frozen=True, kw_only=True)
class SwitchFFConfig:
    """Switch feedforward. Paper defaults: k = 1, capacity factor 1.25 (1.0-1.25 works best) with
    a larger evaluation factor, balance coefficient alpha = 1e-2, z-loss coefficient 1e-3.

    expert_dropout: dropout on the experts' hidden activations (the Switch paper's "expert
                    dropout": 0.4 inside the experts when fine-tuning; 0 for pre-training).
    noop_experts:   Z no-op experts among the router's choices (integrated MoDE).
    bias:           a hidden bias per expert ``bias_in`` [E, F] and one output bias ``bias_out``
                    [D] added to every token, ungated, also to dropped ones (zero-initialised).
                    T5-style Switch has none; a dense MLP with biases needs them to be copied
                    exactly into its experts (moeify.models.upcycle).
    activation:     the experts' hidden activation, one of moeify.layers.ff_common.ACTIVATIONS:
                    "relu" is the paper's (T5's); "gelu_tanh" / "gelu" / "silu" hold copies
                    of a dense MLP with that activation (GPT-2's is "gelu_tanh").
    gated:          SwiGLU experts: a second input matrix ``w_gate`` [E, D, F], hidden
                    units act(x · w_gate) ⊙ (x · w_in) (Mixtral, Qwen-MoE, OLMoE; no biases).
    renormalize:    the k kept softmax gates are rescaled to sum to 1 (Mixtral; Qwen-MoE and
                    OLMoE with ``norm_topk_prob``).
    shared:         a GatedMLPConfig (or MLPConfig): a dense expert every token goes through
                    (Qwen2-MoE, DeepSeekMoE), its output added to the routed experts'; None =
                    none.
    n_shared:       DeepSeekMoE's shared experts: n_shared experts of the routed ones' form and
                    size, always on (instead of ``shared``; moeify.layers.shared_expert).
    shared_gate:    the shared expert's output is scaled by σ(w · x), a learned scalar per
                    token (``shared_gate.weight`` [1, D]; Qwen2-MoE's ``shared_expert_gate``).
    balance_scope:  "batch" (the Switch paper's loss over this forward's tokens) or "global"
                    (f_i over the update's global batch; module docstring).
    lossfree_rate:  gamma of loss-free balancing (0 = off; the paper's 1e-3).
    lossfree_centre: subtract the mean from the bias after each update (not the paper's).
    The initialisation is the Switch paper's 0.1x scale, std sqrt(0.1 / fan_in), which does not
    depend on the model depth."""

    d_model: int
    d_ff: int
    n_experts: int
    k: int = 1
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    dropless: bool = False
    balance_coef: float = 0.01
    z_coef: float = 0.001
    expert_dropout: float = 0.0
    noop_experts: int = 0
    expert_impl: str = "auto"
    bias: bool = False
    activation: str = "relu"
    gated: bool = False
    renormalize: bool = False
    shared: GatedMLPConfig | MLPConfig | None = None
    n_shared: int = 0
    shared_gate: bool = False
    balance_scope: str = "batch"
    lossfree_rate: float = 0.0
    lossfree_centre: bool = False

    def __post_init__(self) -> None:
        check_positive(self, "d_model", "d_ff", "n_experts")
        check_activation(self)
        check_flag(self, "bias", "gated", "renormalize", "lossfree_centre")
        if self.gated and self.bias:
            raise ValueError("SwitchFFConfig: gated experts have no biases; set bias=False")
        check_shared(self)
        if self.balance_scope not in BALANCE_SCOPES:
            raise ValueError(f"SwitchFFConfig.balance_scope must be one of "
                             f"{', '.join(BALANCE_SCOPES)}, got {self.balance_scope!r}")
        check_nonnegative(self, "lossfree_rate")
        if self.noop_experts < 0:
            raise ValueError(f"SwitchFFConfig.noop_experts must be >= 0, got {self.noop_experts}")
        choices = self.n_experts + self.noop_experts
        if not 1 <= self.k <= choices:
            raise ValueError(f"SwitchFFConfig.k must lie in [1, n_experts + noop_experts = "
                             f"{choices}], got {self.k}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SwitchFFConfig.{name} must be positive (use dropless=True to "
                                 f"never drop tokens), got {getattr(self, name)}")
        check_nonnegative(self, "balance_coef", "z_coef")
        check_probability(self, "expert_dropout")
        check_expert_impl(self)

    def build(self) -> "SwitchFeedForward":
        return SwitchFeedForward(self)


class SwitchFeedForward(nn.Module):
    """Aux losses: "balance" (balance_coef > 0) and "z" (z_coef > 0), both over valid tokens.
    Routing: ``aux.routing["router"]``, counts [1, E + Z] of the routed choices before capacity
    (valid tokens only). Stats: fraction_dropped (of the choices of real experts),
    router_entropy, dead_experts (real experts with no routed token), fraction_noop (Z > 0). Running buffers, training only: ``usage``
    [E + Z] routed choices, ``dropped`` [] dropped choices."""

    def __init__(self, config: SwitchFFConfig):
        super().__init__()
        self.config = config
        E, D, Fh = config.n_experts, config.d_model, config.d_ff
        R = E + config.noop_experts
        self.w_router = nn.Parameter(torch.empty(R, D))  # [R, D]
        if config.bias:
            self.bias_out = nn.Parameter(torch.zeros(D))  # [D]
        self.experts = RoutedExperts(E, D, Fh, gated=config.gated, bias=config.bias,
                                     activation=config.activation,
                                     dropout=config.expert_dropout, impl=config.expert_impl)
        rename_legacy_keys(self, EXPERT_KEYS)
        build_shared(self, config)
        if config.lossfree_rate > 0:  # persistent: a resumed run keeps its balance
            self.register_buffer("expert_bias", torch.zeros(R, dtype=torch.float32))
        register_usage(self, "usage", (R,))
        register_usage(self, "dropped", ())
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # Switch §2.4: truncated normal, std sqrt(0.1 / fan_in) (a tenth of the usual scale).
        c = self.config
        trunc_normal_(self.w_router, (0.1 / c.d_model) ** 0.5)
        trunc_normal_(self.experts.w_in, (0.1 / c.d_model) ** 0.5)
        trunc_normal_(self.experts.w_out, (0.1 / c.d_ff) ** 0.5)
        if c.gated:
            trunc_normal_(self.experts.w_gate, (0.1 / c.d_model) ** 0.5)
        reset_shared_gate(self, c)
        if c.bias:
            self.experts.bias_in.zero_()
            self.bias_out.zero_()

    def capacity(self, num_rows: int) -> int | None:
        """Pairs each expert may take out of ``num_rows`` tokens (None: dropless)."""
        c = self.config
        if c.dropless:
            return None
        cf = c.capacity_factor if self.training else c.eval_capacity_factor
        return expert_capacity(num_rows, c.n_experts + c.noop_experts, cf, c.k)

    def forward(self, x_BTD: torch.Tensor, *,
                valid_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, Aux]:
        c = self.config
        check_token_input("SwitchFeedForward", x_BTD, c.d_model, valid_BT)
        E, R = c.n_experts, c.n_experts + c.noop_experts
        B, T, D = x_BTD.shape
        x_MD = x_BTD.reshape(B * T, D)
        M, K, N = B * T, c.k, B * T * c.k
        valid_M = None if valid_BT is None else valid_BT.reshape(M)

        logits_MR = router_logits(x_MD, self.w_router)  # float32, also under autocast (§2.4)
        top = softmax_topk(logits_MR, K, renormalize=c.renormalize,
                           bias=self.expert_bias if c.lossfree_rate > 0 else None)
        # Best choice first: position priority puts every first choice before any second one.
        gates_MK, order_MK = top.gates.sort(dim=-1, descending=True, stable=True)
        idx_MK = top.idx.gather(-1, order_MK)

        real_MK = idx_MK < E
        valid_MK = (torch.ones_like(real_MK) if valid_M is None
                    else valid_M[:, None].expand(M, K))
        cap = None if T == 1 else self.capacity(M)  # the decoding rule (module docstring)
        if cap is None:
            keep_MK = valid_MK & real_MK
        else:
            keep_MK = capacity_mask(idx_MK, R, cap, valid_M=valid_M) & real_MK

        y_MD = self.experts(x_MD, idx_MK, gates_MK, keep_MK,
                            rows=None if cap is None else min(N, E * cap))
        y_BTD = y_MD.view(B, T, D)
        if c.bias:
            y_BTD = y_BTD + self.bias_out.to(y_BTD.dtype)
        y_BTD = add_shared(self, c, y_BTD, x_BTD, valid_BT)

        aux = Aux()
        if c.balance_coef != 0 and c.balance_scope == "global":
            aux.balance["balance"] = GlobalBalance(
                c.balance_coef, mean_router_probs(top.scores, valid_M),
                count_selections(idx_MK[:, 0], R, valid_M).float())
        elif c.balance_coef != 0:
            aux.losses["balance"] = c.balance_coef * switch_balance_loss(
                top.scores, idx_MK[:, 0], valid_M)
        if c.z_coef != 0:
            aux.losses["z"] = c.z_coef * z_loss(logits_MR, valid_M)
        # Routed choices before capacity (dropped ones count: they were chosen).
        record = routing_record("switch", idx_MK, R, gates_MK, valid_MK,
                                n_real=E if c.noop_experts else None)
        counts_R = record.counts[0]
        aux.routing["router"] = record
        aux.stats.update(routing_stats(counts_R, top.scores, valid_M, n_real=E))
        with torch.no_grad():
            routed_real = (valid_MK & real_MK).sum()
            dropped = (valid_MK & real_MK & ~keep_MK).sum()
            aux.stats["fraction_dropped"] = dropped.float() / routed_real.clamp_min(1).float()
            if c.noop_experts:
                aux.stats["fraction_noop"] = (
                    counts_R[E:].sum().float() / valid_MK.sum().clamp_min(1).float())
        accumulate_usage(self, "usage", counts_R)
        accumulate_usage(self, "dropped", dropped)
        return y_BTD, aux
