"""Mixture-of-Recursions (Bae et al., NeurIPS 2025, arXiv 2507.10524): one shared recursion block
(a stack of ordinary blocks, Φ') applied up to N_r times, and a router that decides how many of
those recursions each token takes.

The model places the module (models/lm.py, ``ModelConfig.recursion``): with the paper's default
"Middle-Cycle" sharing (Sec. 2.1) the first and the last layer keep their own weights and the
L - 2 layers between them are N_r repetitions of one stack of (L - 2) / N_r blocks; with "Cycle"
sharing the whole depth is N_r repetitions of L / N_r blocks. The layer norms are shared with
their block (the authors' ``ln_share: true``). f(H, Φ') below is that stack, residuals included:
f(H) = Block_m(... Block_1(H)), the map the paper's Eq. 1 writes as H^{l+1} = f(H^l; Φ_l).

Expert-choice routing (Sec. 2.2.1, Eq. 2; moeify.ops.recursion_routing):

    g_t^r     = α · sigmoid(θ_rᵀ H_t^r)                              one router θ_r per step
    H_t^{r+1} = g_t^r · f(H_t^r, Φ') + H_t^r   for the K_r tokens kept at step r
    H_t^{r+1} = H_t^r                          for the others (bit-exact)

The kept tokens are the top K_r = max(1, floor(β_r T)) of those kept at step r - 1 (hierarchical
filtering), β = (1, (N_r - 1) / N_r, ..., 1 / N_r) by default. f runs on the kept tokens only, at
their original positions (RoPE sees true distances) and they attend only to each other: the
paper's recursion-wise attention. The top-k looks at the whole sequence; the paper's
auxiliary loss (its choice) teaches the router causality with binary cross-entropy of the router
logits against top-k membership over the step's candidates,

    L_aux = coef · Σ_r mean_{t kept at r-1} BCE(θ_rᵀ H_t^r, [t kept at r])      ("aux_loss")

or its auxiliary router: a second linear router per step on the stop-gradient hidden state
trained with the same BCE, which decoding then consults ("aux_router").

Token-choice routing (Sec. 2.2.1, Eq. 3):

    g_t = α · softmax(Θᵀ H_t^1) ∈ R^{N_r},  i_t = argmax_j g_t^j
    H_t^{r+1} = f(H_t^r, Φ')                   for r < i_t
    out_t     = g_t^{i_t} · f(H_t^{i_t}, Φ') + H_t^1

(the paper prints g_t^r on every step; its authors' code gates only the last one, as written
here), with the balancing loss of the paper (Switch's N_r · Σ_i f_i P_i over the token-depth
assignment, coefficient 0.1 in the authors' configuration) and the router z-loss
(mean logsumexp(Θᵀ H^1)², 1e-5). The authors' code also offers loss-free balancing
(``balancing: loss_free``, after Wang et al. 2024, arXiv 2408.15664): a bias b ∈ R^{N_r},
not trained by gradients, shifts the choice only,

    i_t = argmax_j (g_t^j + b_j)          the gate stays g_t^{i_t}, unbiased

and after each optimizer step b_j += u · sign(mean_k c_k - c_j), c_j the tokens that chose
depth j during the update (u = ``lossfree_rate``, the authors' 0.001; moeify.train.balancing
applies it, as for the feedforward MoEs). At recursion r every token with i_t >= r is active; the others
are neither queries nor keys there.

Recursion-wise KV caching (Sec. 2.2.2, the default): with a cache every step r keeps its own KV
cache per shared block, and a token's keys and values enter step r's cache as valid only if the
token took step r, so later tokens attend at step r only to tokens that took it, exactly as the
training forward does. Decoding (a cache) routes causally: token-choice is causal already, so
cached decoding equals the full forward; expert-choice replaces each step's top-k by the
threshold the auxiliary loss trains, a positive router logit (sigmoid > 1/2, tanh > 0; the aux
router's logit when there is one; the authors compare the raw logit with 0.5 for their
"linear" gate, moeify with 0 as for the others), a step with β_r = 1 keeping every candidate
as its top-k does.

Recursive KV sharing (Sec. 2.2.2, ``kv_sharing=True``; the authors' ``kv_sharing.enable``): the
keys and values of the first recursion step are computed for every token and reused by every
later step, which computes queries only. With K^1_j, V^1_j the keys and values shared block j
computes at step 1 (every token of the sequence, its own position),

    step 1:  the stack runs on every token; its K^1_j, V^1_j are kept
    step r:  Attn_j(Q = W_q LN(h_t^r), K = K^1_j, V = V^1_j) for the tokens that take step r,
             causal in position: token t reads K^1_j, V^1_j of the tokens at positions <= t

so a token attends at a later step also to tokens that stopped early, through their first-step
keys and values. Routing, gates and losses are unchanged. The authors run the whole sequence
as queries at every step and keep the rows of the tokens that take it (their README: "computed
all sequences against a shared KV cache ... then extracted by masking"); moeify runs only those
queries (expert-choice: the K_r gathered tokens), the same outputs with less compute. Step 1
runs every token even where β_1 < 1 (its update still goes to its K_1 tokens only), as the
authors' code does, so that every token has first-step keys and values. A cache then holds
the first step's KV only: 1 / N_r of the recursion-wise cache's memory, every entry valid.

Weight mapping from the authors' code (raymin0223/mixture_of_recursions):
    w_router[r]        expert-choice: layers[1 + r].mor_router.router.weight[0]
                       token-choice:  the MoR layer's mor_router.router.weight (row i = depth i)
    w_aux_router[r]    layers[1 + r].mlp_router.router.weight[0]  (sampling "aux_router")
    blocks[j]          the shared Llama layer j of the recursion (layers[1 + j]'s weights)

Deviations, each deliberate:
- Losses are means over the (candidate) tokens; the authors divide the z-loss and balancing
  loss also by num_items_in_batch / (B·T), the gradient-accumulation factor of Hugging Face's
  loss normalisation (1 for one batch per step), which moeify's trainer applies itself.
- Token-choice training runs each recursion over the whole sequence with the inactive tokens
  masked out as keys (``valid_BT``) and their outputs discarded: the same outputs and gradients
  as the authors' per-row compaction, with static shapes (torch.compile) but without its
  compute saving. Expert-choice gathers its K_r tokens (static K_r) and saves it.
- A cache stores every token at every step and marks the skipped ones invalid (as Mixture-of-
  Depths does): attention is the paper's, the memory is that of a full cache.
- The authors' random routers, capacity and balancing warm-ups, and KV sharing's
  ``update_cache`` variant (a later step's tokens overwrite their own shared entries with fresh
  keys and values; off in the authors' configurations) are not implemented.
- The routers are initialised N(0, router_std²), std 0.02 (the authors' initializer_range).

Shape legend: B batch, T tokens, K tokens kept at a step, D d_model, N recursions N_r.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeify.layers.common import (
    Aux,
    check_flag,
    check_nonnegative,
    check_positive,
    check_token_input,
    record_depth_routing,
    register_usage,
)
from moeify.layers.kv_cache import SharedKVCache
from moeify.ops.aux_losses import switch_balance_loss, z_loss
from moeify.ops.depth_routing import (causal_route, causal_rule_stats, gather_tokens,
                                     membership_bce, scatter_tokens)
from moeify.ops.recursion_routing import (
    EXPERT_GATES,
    TOKEN_GATES,
    default_capacities,
    expert_gate,
    hierarchical_topk,
    router_logits,
    token_choice,
)

ROUTINGS = ("expert", "token")
SHARINGS = ("middle_cycle", "cycle")
CAUSAL = ("aux_loss", "aux_router")


@dataclass(frozen=True, kw_only=True)
class MoRConfig:
    """Mixture-of-Recursions over a shared stack (the model builds the stack; see the module
    docstring). Defaults are the authors' configurations for SmolLM-360M with N_r = 3.

    n_recursions: N_r, the repetitions of the shared stack (at least 2).
    routing:      "expert" (expert-choice, the paper's best) or "token" (token-choice).
    sharing:      "middle_cycle" (first and last layer unshared, the paper's default) or "cycle".
    capacities:   expert-choice β_r per step, descending in (0, 1]; None: (N_r - r + 1) / N_r.
    gate:         expert: "sigmoid" | "tanh" | "linear"; token: "softmax" | "sigmoid";
                  None: sigmoid for expert, softmax for token.
    alpha:        the gate's scale α; None: 0.1 for expert, 1.0 for token.
    causal:       expert-choice causality: "aux_loss" (BCE on the router) or "aux_router".
    aux_coef:     coefficient of that BCE (0.001).
    balance_coef: token-choice balancing-loss coefficient (0.1).
    z_coef:       router z-loss coefficient; None: 0 for expert, 1e-5 for token.
    router_std:   the routers' initial standard deviation (0.02).
    kv_sharing:   recursive KV sharing (every later step attends to the first step's keys and
                  values; module docstring); False: recursion-wise KV caching.
    lossfree_rate: token-choice loss-free balancing's bias step u (0 = off; the authors' 0.001
                  with balancing "loss_free", where they also drop the balancing loss:
                  balance_coef=0); a buffer ``expert_bias`` [N_r]."""

    d_model: int
    n_recursions: int = 3
    routing: str = "expert"
    sharing: str = "middle_cycle"
    capacities: tuple[float, ...] | None = None
    gate: str | None = None
    alpha: float | None = None
    causal: str = "aux_loss"
    aux_coef: float = 0.001
    balance_coef: float = 0.1
    z_coef: float | None = None
    router_std: float = 0.02
    kv_sharing: bool = False
    lossfree_rate: float = 0.0

    def __post_init__(self) -> None:
        check_positive(self, "d_model")
        if not self.router_std > 0:
            raise ValueError(f"MoRConfig.router_std must be positive, got {self.router_std!r}")
        if isinstance(self.n_recursions, bool) or not isinstance(self.n_recursions, int) \
                or self.n_recursions < 2:
            raise ValueError(f"MoRConfig.n_recursions must be an integer >= 2, "
                             f"got {self.n_recursions!r}")
        for name, allowed in (("routing", ROUTINGS), ("sharing", SHARINGS), ("causal", CAUSAL)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MoRConfig.{name} must be one of {allowed}, "
                                 f"got {getattr(self, name)!r}")
        gates = EXPERT_GATES if self.routing == "expert" else TOKEN_GATES
        if self.gate is not None and self.gate not in gates:
            raise ValueError(f"MoRConfig.gate for {self.routing}-choice routing must be one of "
                             f"{gates}, got {self.gate!r}")
        check_flag(self, "kv_sharing")
        check_nonnegative(self, "aux_coef", "balance_coef", "lossfree_rate")
        if self.lossfree_rate and self.routing != "token":
            raise ValueError("MoRConfig.lossfree_rate balances token-choice depths; set it to 0 "
                             "for expert-choice routing (its capacities fix the depths)")
        if self.z_coef is not None:
            check_nonnegative(self, "z_coef")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"MoRConfig.alpha must be positive, got {self.alpha!r}")
        if self.capacities is not None:
            caps = tuple(self.capacities)
            object.__setattr__(self, "capacities", caps)
            if len(caps) != self.n_recursions or not all(0.0 < c <= 1.0 for c in caps) or any(
                    a < b for a, b in zip(caps, caps[1:])):
                raise ValueError(f"MoRConfig.capacities must hold n_recursions="
                                 f"{self.n_recursions} fractions in (0, 1], descending "
                                 f"(hierarchical filtering), got {self.capacities!r}")

    @property
    def betas(self) -> tuple[float, ...]:
        return self.capacities or default_capacities(self.n_recursions)

    @property
    def gate_fn(self) -> str:
        return self.gate or ("sigmoid" if self.routing == "expert" else "softmax")

    @property
    def gate_alpha(self) -> float:
        return self.alpha if self.alpha is not None else (
            0.1 if self.routing == "expert" else 1.0)

    @property
    def z_weight(self) -> float:
        return self.z_coef if self.z_coef is not None else (
            0.0 if self.routing == "expert" else 1e-5)

    def stack_layers(self, n_layers: int) -> tuple[int, int]:
        """(first shared layer, layers in the shared stack) of an n_layers-deep model; ValueError
        when the depth does not split into N_r equal repetitions."""
        unshared = 2 if self.sharing == "middle_cycle" else 0
        depth = n_layers - unshared
        if depth < self.n_recursions or depth % self.n_recursions:
            raise ValueError(f"Mixture-of-Recursions with {self.sharing} sharing needs "
                             f"n_layers - {unshared} to be a positive multiple of n_recursions="
                             f"{self.n_recursions}, got n_layers={n_layers}")
        return unshared // 2, depth // self.n_recursions

    def build(self, blocks: nn.ModuleList) -> "MixtureOfRecursions":
        return MixtureOfRecursions(self, blocks)


class RecursionCache:
    """Recursion-wise KV caches: ``caches[r][j]`` is the cache of shared block j at step r; with
    recursive KV sharing only ``caches[0]``, the first step's, which every step reads.
    ``len`` is the number of tokens seen (every step stores every token, valid or not)."""

    def __init__(self, caches: list[list]):
        self.caches = caches

    def __len__(self) -> int:
        return len(self.caches[0][0])


class MixtureOfRecursions(nn.Module):
    """The shared stack ``blocks`` (an nn.ModuleList of blocks with the block signature) applied
    up to N_r times under routing; has the block signature itself. Aux: losses "mor.router_bce"
    / "mor.aux_router_bce" (expert, training forward), "mor.balance" (token), "mor.z_loss"; stats
    "mor.mean_depth" and per step "mor.fraction_r{r}" (expert-choice training also
    "mor.causal_agreement_r{r}", how often the decoding rule agrees with the top-k, and
    "mor.causal_fraction_r{r}", how many it would route); routing record "mor" (tokens by final
    depth, [1, N_r]; loss-free balancing's counts); the blocks' own Aux under "rec{r}.{j}.".
    Running buffer ``usage`` [N_r]; with ``lossfree_rate`` the bias buffer ``expert_bias``."""

    def __init__(self, config: MoRConfig, blocks: nn.ModuleList):
        super().__init__()
        self.config = config
        self.blocks = blocks
        N, D = config.n_recursions, config.d_model
        self.w_router = nn.Parameter(torch.empty(N, D))  # θ_r (expert) / Θ's columns (token)
        self.w_aux_router = None
        if config.routing == "expert" and config.causal == "aux_router":
            self.w_aux_router = nn.Parameter(torch.empty(N, D))
        register_usage(self, "usage", (N,))
        if config.lossfree_rate > 0:  # a buffer: moeify.train.balancing moves it, not autograd
            self.register_buffer("expert_bias", torch.zeros(N, dtype=torch.float32))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for w in (self.w_router, self.w_aux_router):
            if w is not None:
                nn.init.normal_(w, std=self.config.router_std)

    def new_cache(self) -> RecursionCache:
        steps = 1 if self.config.kv_sharing else self.config.n_recursions
        return RecursionCache([[b.attention.new_cache() for b in self.blocks]
                               for _ in range(steps)])

    def _step_caches(self, cache: RecursionCache | None) -> list | None:
        """The KV cache of each step and shared block, [r][j], or None (no cache: every step
        attends among its own tokens). Recursion-wise: the decoding cache's own. KV sharing:
        step 0 fills the first-step caches (the decoding cache's, or fresh ones for this
        forward) and every later step reads them through a SharedKVCache."""
        if not self.config.kv_sharing:
            return None if cache is None else cache.caches
        first = cache.caches[0] if cache is not None else [b.attention.new_cache()
                                                           for b in self.blocks]
        shared = [SharedKVCache(kv) for kv in first]
        return [first] + [shared] * (self.config.n_recursions - 1)

    def _stack(self, x_BTD, r, caches, positions_BT, valid_BT, aux: Aux):
        """f(x, Φ'): the shared blocks in order, as step r (its caches, its aux prefix)."""
        for j, block in enumerate(self.blocks):
            x_BTD, block_aux = block(x_BTD, None, cache=None if caches is None else caches[r][j],
                                     positions_BT=positions_BT, valid_BT=valid_BT)
            aux.update(block_aux, f"rec{r}.{j}.")
        return x_BTD

    def forward(
        self,
        x_BTD: torch.Tensor,
        mem_BMD: torch.Tensor | None = None,
        *,
        cache: RecursionCache | None = None,
        positions_BT: torch.Tensor | None = None,
        valid_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Aux]:
        if mem_BMD is not None:
            raise ValueError("Mixture-of-Recursions does not support XL memory (a recursion's "
                             "memory would hold tokens it never saw); use RoPE attention "
                             "without memory")
        check_token_input("MixtureOfRecursions", x_BTD, self.config.d_model, valid_BT)
        B, T, _ = x_BTD.shape
        if positions_BT is None:
            past = 0 if cache is None else len(cache)
            positions_BT = torch.arange(past, past + T, device=x_BTD.device).expand(B, T)
        caches = self._step_caches(cache)
        if self.config.routing == "token":
            return self._token_choice(x_BTD, caches, positions_BT, valid_BT, cache is not None)
        if cache is None:
            return self._expert_choice(x_BTD, caches, positions_BT, valid_BT)
        return self._expert_choice_causal(x_BTD, caches, positions_BT, valid_BT)

    # ------------------------------------------------------------------ expert-choice

    def _expert_choice(self, x_BTD, caches, positions_BT, valid_BT):
        c = self.config
        aux = Aux()
        h_BTD = x_BTD
        active_BT = valid_BT  # None: every token is a candidate of step 0
        bce = zl = None
        steps, gates = [], []
        for r, beta in enumerate(c.betas):
            h_in_BTD = h_BTD
            logits_BT = router_logits(h_BTD, self.w_router[r:r + 1])[..., 0]
            gate_BT = expert_gate(logits_BT, c.gate_fn, c.gate_alpha)
            idx_BK, selected_BT, keep_BK = hierarchical_topk(gate_BT, beta, active_BT, valid_BT)
            x_BKD = gather_tokens(h_BTD, idx_BK)
            if caches is not None and r == 0:  # KV sharing: every token's first-step KV
                y_BKD = gather_tokens(self._stack(h_BTD, 0, caches, positions_BT, valid_BT,
                                                  aux), idx_BK)
            else:
                y_BKD = self._stack(x_BKD, r, caches, positions_BT.gather(1, idx_BK), keep_BK,
                                    aux)
            g_BK = gate_BT.gather(1, idx_BK)
            if keep_BK is not None:
                g_BK = g_BK * keep_BK
            h_BTD = scatter_tokens(h_BTD, idx_BK, x_BKD + g_BK[..., None].to(x_BTD.dtype) * y_BKD)
            causal_BT = logits_BT
            if self.w_aux_router is not None:  # reads H^r without passing gradient into it
                causal_BT = router_logits(h_in_BTD.detach(), self.w_aux_router[r:r + 1])[..., 0]
            if c.aux_coef:
                term = membership_bce(causal_BT, selected_BT, active_BT)
                bce = term if bce is None else bce + term
            if c.z_weight:
                term = z_loss(logits_BT[..., None], active_BT)
                zl = term if zl is None else zl + term
            steps.append((selected_BT, active_BT, causal_BT))
            gates.append(gate_BT)
            active_BT = selected_BT
        if bce is not None:
            name = "router_bce" if self.w_aux_router is None else "aux_router_bce"
            aux.losses["mor." + name] = c.aux_coef * bce
        if zl is not None:
            aux.losses["mor.z_loss"] = c.z_weight * zl
        self._stats(aux, [s[0] for s in steps], gates, valid_BT, steps)
        return h_BTD, aux

    def _expert_choice_causal(self, x_BTD, caches, positions_BT, valid_BT):
        c = self.config
        aux = Aux()
        h_BTD = x_BTD
        active_BT = torch.ones(x_BTD.shape[:2], dtype=torch.bool, device=x_BTD.device) \
            if valid_BT is None else valid_BT
        routed, gates = [], []
        for r, beta in enumerate(c.betas):
            logits_BT = router_logits(h_BTD, self.w_router[r:r + 1])[..., 0]
            gate_BT = expert_gate(logits_BT, c.gate_fn, c.gate_alpha)
            if beta < 1.0:
                rule_BT = logits_BT if self.w_aux_router is None else router_logits(
                    h_BTD, self.w_aux_router[r:r + 1])[..., 0]
                active_BT = causal_route(rule_BT, active_BT)
            # KV sharing: the first step stores every token's keys and values, valid
            runs_BT = valid_BT if c.kv_sharing and r == 0 else active_BT
            y_BTD = self._stack(h_BTD, r, caches, positions_BT, runs_BT, aux)
            h_BTD = torch.where(active_BT[..., None],
                                h_BTD + gate_BT[..., None].to(x_BTD.dtype) * y_BTD, h_BTD)
            routed.append(active_BT)
            gates.append(gate_BT)
        self._stats(aux, routed, gates, valid_BT, None)
        return h_BTD, aux

    # ------------------------------------------------------------------ token-choice

    def _token_choice(self, x_BTD, caches, positions_BT, valid_BT, decoding):
        c = self.config
        aux = Aux()
        logits_BTN = router_logits(x_BTD, self.w_router)
        probs_BTN, depth_BT, gate_BT = token_choice(
            logits_BTN, c.gate_fn, c.gate_alpha,
            bias=self.expert_bias if c.lossfree_rate > 0 else None)
        g_BT1 = gate_BT[..., None].to(x_BTD.dtype)
        h_BTD, out_BTD = x_BTD, x_BTD
        routed = []
        for r in range(c.n_recursions):
            active_BT = depth_BT >= r
            if valid_BT is not None:
                active_BT = active_BT & valid_BT
            # every token takes step 0: with KV sharing its keys and values stay unmasked
            runs_BT = valid_BT if c.kv_sharing and r == 0 else active_BT
            y_BTD = self._stack(h_BTD, r, caches, positions_BT, runs_BT, aux)
            done_BT1 = (active_BT & (depth_BT == r))[..., None]
            out_BTD = torch.where(done_BT1, x_BTD + g_BT1 * y_BTD, out_BTD)
            h_BTD = torch.where(active_BT[..., None], y_BTD, h_BTD)
            routed.append(active_BT)
        if not decoding and c.balance_coef:
            valid_M = None if valid_BT is None else valid_BT.flatten()
            aux.losses["mor.balance"] = c.balance_coef * switch_balance_loss(
                probs_BTN.flatten(0, 1), depth_BT.flatten(), valid_M)
        if not decoding and c.z_weight:
            aux.losses["mor.z_loss"] = c.z_weight * z_loss(logits_BTN, valid_BT)
        self._stats(aux, routed, [gate_BT] * c.n_recursions, valid_BT, None)
        return out_BTD, aux

    # ------------------------------------------------------------------ statistics

    @torch.no_grad()
    def _stats(self, aux: Aux, routed: list, gates: list, valid_BT, steps) -> None:
        """``routed[r]``: tokens that took step r; ``gates[r]``: the gate of step r's update.
        The routing record counts tokens by final depth, with the gate of their last update."""
        valid = torch.ones_like(routed[0]) if valid_BT is None else valid_BT
        n_valid = valid.sum().clamp_min(1).float()
        took = torch.stack([(a & valid).sum() for a in routed])  # tokens that took each step
        last = [a & valid & ~b for a, b in zip(routed, routed[1:] + [torch.zeros_like(valid)])]
        gate_sum = sum((g.float() * m).sum() for g, m in zip(gates, last))
        for r, n in enumerate(took):
            aux.stats[f"mor.fraction_r{r}"] = n.float() / n_valid
        aux.stats["mor.mean_depth"] = took.sum().float() / n_valid
        # tokens whose final depth is r + 1: took step r but not step r + 1
        counts = took - torch.cat([took[1:], took.new_zeros(1)])
        if steps is not None:  # expert-choice training: how the causal rule does
            for r, (selected_BT, cand_BT, logits_BT) in enumerate(steps):
                aux.stats[f"mor.causal_agreement_r{r}"], aux.stats[f"mor.causal_fraction_r{r}"] \
                    = causal_rule_stats(logits_BT, selected_BT, cand_BT)
        record_depth_routing(self, aux, "mor", counts, gate_sum)

