"""Mixture-of-Depths (Raposo et al. 2024): a scalar router decides which tokens of each sequence a
whole block (attention + feedforward) processes; the others skip it unchanged.

Training and teacher-forced evaluation (no cache), per sequence of T tokens
(Raposo et al. 2024, arXiv 2404.02258):

    r_t    = wᵀ x_t + b                              scalar router, float32
    sel    = top-C tokens by r, C = ceil(capacity · T) (at least 1), in ascending position
    x'_sel = x_sel + r_sel · (f(x_sel) - x_sel)       f: the block, run ONLY on the selected tokens
    x'_t   = x_t                                     for every skipped token (bit-exact)

Within f the selected tokens keep their original positions (``positions_BT``), so RoPE and the
causal mask see the true distances, and skipped tokens are neither queries nor keys/values.
The router weight multiplies the block's residual update f(x) - x, not the residual stream, so
the router receives a gradient. ``ceil`` (``moeify.ops.routing.expert_choice_count``)
so that capacity · T need not be an integer and a short sequence still routes one token. With
``valid_BT`` (right-padded batches, e.g. zero-shot scoring), T is each sequence's own number of
real tokens and padding is never routed, so a padded sequence is processed exactly as it would
be alone.

Deviation: the router has a scalar bias b (initialised to 0, so the router starts as the paper's
wᵀx). It does not change which tokens the top-k picks, but without it the causal rule
sigmoid(r) > 0.5 could only split centred inputs at wᵀx = 0, i.e. route about half of them
whatever the capacity; with it, method 1's BCE can move the threshold to the capacity quantile.

Causal routing (the paper's sampling section). The sequence top-k looks at future tokens, so
sampling cannot use it. Two learned causal rules are trained on top-k membership with binary
cross-entropy, selectable:

    "aux_bce":   the BCE is applied to the router logits themselves (method 1; it changes the
                 router, costing a little LM loss); route iff sigmoid(r) > 0.5.
    "predictor": a small MLP reads the stop-gradient block input and is trained with the BCE
                 (method 2; no effect on the LM); route iff sigmoid(predictor(x)) > 0.5.

With a cache (decoding), routing always uses the causal rule, never the top-k: the block runs on
every new token but receives ``valid_BT = routed``, so the attention stores the skipped tokens'
keys as invalid (they are never attended to later), and skipped tokens keep x exactly.

Staged MoDE (MoD §4): wrap a block whose feedforward is an MoE (SigmaMoE or SwitchFeedForward):
the MoD router decides whether a token enters the block at all (saving attention compute too),
then the block's MoE routes the entered tokens among its experts. Integrated MoDE is
``SwitchFFConfig(noop_experts=Z)`` (see switch_ff.py).

XL memory is not supported: the memory would hold all tokens of the previous chunk while the
block sees only the routed ones; use RoPE (or no positional memory) with MoD.

Shape legend: B batch, T tokens, C routed tokens per sequence, D d_model, H predictor width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeify.layers.common import (
    Aux,
    check_nonnegative,
    check_positive,
    check_token_input,
    init_scale,
    load_scalars_as_vectors,
    record_depth_routing,
    register_usage,
)
from moeify.ops.depth_routing import (
    causal_route,
    causal_rule_stats,
    gather_tokens,
    membership_bce,
    scatter_tokens,
)
from moeify.ops import routing

CAUSAL_ROUTERS = ("aux_bce", "predictor")


@dataclass(frozen=True, kw_only=True)
class MoDConfig:
    """Mixture-of-Depths around one block. Paper's best: capacity 0.125 on every other block.

    causal_router:    "aux_bce" or "predictor" (see the module docstring).
    aux_coef:         coefficient of that BCE loss (returned as "mod.router_bce" or
                      "mod.predictor_bce"); 0 leaves the causal rule untrained.
    predictor_hidden: hidden width H of the predictor MLP (D -> H -> 1, ReLU).
    n_layers:         model depth L; the router is initialised N(0, s² / d), s = sqrt(2 / L),
                      like the other routers of the library."""

    d_model: int
    capacity: float = 0.125
    causal_router: str = "aux_bce"
    aux_coef: float = 0.01
    predictor_hidden: int = 64
    n_layers: int = 1

    def __post_init__(self) -> None:
        check_positive(self, "d_model", "predictor_hidden", "n_layers")
        if not 0.0 < self.capacity <= 1.0:
            raise ValueError(f"MoDConfig.capacity is the fraction of tokens that enter the "
                             f"block and must lie in (0, 1], got {self.capacity}")
        if self.causal_router not in CAUSAL_ROUTERS:
            raise ValueError(f"MoDConfig.causal_router must be one of {CAUSAL_ROUTERS}, "
                             f"got {self.causal_router!r}")
        check_nonnegative(self, "aux_coef")

    def build(self, block: nn.Module) -> "MixtureOfDepths":
        return MixtureOfDepths(self, block)


class MixtureOfDepths(nn.Module):
    """Wraps ``block`` and has its signature. Returns the block's Aux (keys unchanged) plus
    "mod.*": loss "mod.router_bce" / "mod.predictor_bce" (when aux_coef > 0, not while decoding,
    where there is no top-k target); stats "mod.fraction_routed" (valid tokens that entered),
    "mod.predictor_accuracy" (how often the causal rule agrees with top-k membership) and
    "mod.causal_fraction_routed" (how many the causal rule would route). Running buffer
    ``usage`` [2]: skipped and routed valid tokens, training only."""

    def __init__(self, config: MoDConfig, block: nn.Module):
        super().__init__()
        self.config = config
        self.block = block
        # Names: moeify.layers.common (the naming convention). One router output: [D], not
        # [1, D], so that it stays a vector (no weight decay: the trainer decays matrices only,
        # and an optimizer state saved with it in the no-decay group still loads).
        self.w_router = nn.Parameter(torch.empty(config.d_model))
        self.bias_router = nn.Parameter(torch.zeros(1))  # [1], not 0-dim: FSDP2 shards dim 0
        self.predictor = None
        if config.causal_router == "predictor":
            self.predictor = nn.Sequential(
                nn.Linear(config.d_model, config.predictor_hidden), nn.ReLU(),
                nn.Linear(config.predictor_hidden, 1))
        register_usage(self, "usage", (2,))
        load_scalars_as_vectors(self, "bias_router")
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        c = self.config
        nn.init.normal_(self.w_router, std=init_scale(c.n_layers) / c.d_model ** 0.5)

    def router_logits(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """r = wᵀx + b, float32 [B, T] (also under autocast: the top-k is sensitive to rounding)."""
        return routing.router_logits(x_BTD, self.w_router[None], self.bias_router).squeeze(-1)

    def causal_logits(self, x_BTD: torch.Tensor, logits_BT: torch.Tensor) -> torch.Tensor:
        """Logits of the causal rule: the router itself, or the stop-gradient predictor."""
        if self.predictor is None:
            return logits_BT
        return self.predictor(x_BTD.detach()).squeeze(-1).float()

    def forward(
        self,
        x_BTD: torch.Tensor,
        mem_BMD: torch.Tensor | None = None,
        *,
        cache=None,
        positions_BT: torch.Tensor | None = None,
        valid_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Aux]:
        if mem_BMD is not None:
            raise ValueError("Mixture-of-Depths does not support XL memory (the memory would "
                             "hold tokens the block never saw); use RoPE attention without "
                             "memory for routed blocks")
        check_token_input("MixtureOfDepths", x_BTD, self.config.d_model, valid_BT)
        logits_BT = self.router_logits(x_BTD)
        causal_BT = self.causal_logits(x_BTD, logits_BT)
        if cache is not None:
            return self._decode(x_BTD, logits_BT, causal_BT, cache, positions_BT, valid_BT)

        B, T, D = x_BTD.shape
        c = self.config
        idx_BC, selected_BT = routing.expert_choice(logits_BT, c.capacity, valid_BS=valid_BT)
        if positions_BT is None:
            positions_BT = torch.arange(T, device=x_BTD.device).expand(B, T)
        pos_BC = positions_BT.gather(1, idx_BC)
        # With padding, a row may route fewer than C tokens: the other columns (and padding)
        # are invalid inside the block and keep their input.
        valid_BC = None if valid_BT is None else selected_BT.gather(1, idx_BC)
        x_BCD = gather_tokens(x_BTD, idx_BC)
        y_BCD, block_aux = self.block(x_BCD, None, cache=None, positions_BT=pos_BC,
                                      valid_BT=valid_BC)
        r_BC = logits_BT.gather(1, idx_BC)
        if valid_BC is not None:
            r_BC = r_BC * valid_BC
        r_BC1 = r_BC[..., None].to(x_BTD.dtype)
        out_BTD = scatter_tokens(x_BTD, idx_BC, x_BCD + r_BC1 * (y_BCD - x_BCD))

        aux = Aux().update(block_aux)
        if c.aux_coef != 0:
            name = "router_bce" if self.predictor is None else "predictor_bce"
            aux.losses["mod." + name] = c.aux_coef * membership_bce(causal_BT, selected_BT,
                                                                    valid_BT)
        self._stats(aux, selected_BT, valid_BT, causal_BT)
        return out_BTD, aux

    def _decode(self, x_BTD, logits_BT, causal_BT, cache, positions_BT, valid_BT):
        routed_BT = causal_route(causal_BT, valid_BT)
        y_BTD, block_aux = self.block(x_BTD, None, cache=cache, positions_BT=positions_BT,
                                      valid_BT=routed_BT)
        r_BT1 = logits_BT[..., None].to(x_BTD.dtype)
        out_BTD = torch.where(routed_BT[..., None], x_BTD + r_BT1 * (y_BTD - x_BTD), x_BTD)
        aux = Aux().update(block_aux)
        self._stats(aux, routed_BT, valid_BT, None)
        return out_BTD, aux

    @torch.no_grad()
    def _stats(self, aux: Aux, routed_BT, valid_BT, causal_BT) -> None:
        valid = torch.ones_like(routed_BT) if valid_BT is None else valid_BT
        n_valid = valid.sum()
        n_routed = (routed_BT & valid).sum()
        aux.stats["mod.fraction_routed"] = n_routed.float() / n_valid.clamp_min(1).float()
        if causal_BT is not None:
            aux.stats["mod.predictor_accuracy"], aux.stats["mod.causal_fraction_routed"] = \
                causal_rule_stats(causal_BT, routed_BT, valid_BT)
        record_depth_routing(self, aux, "mod", torch.stack([n_valid - n_routed, n_routed]))
