"""What every layer shares: the Aux record it returns beside its output, the training-only usage
buffers of routed layers, the config checks, the initialisers of the papers' recipes, and the
load-time mapping of moved state-dict keys.

Parameter names (they are state-dict keys: checkpoints, Hugging Face key maps, expert
parallelism and upcycling name them). Names say the role; the shape is documented beside the
Parameter (and in each file's shape legend), not spelled into the name:

    router (selection) weights   ``w_router`` [X, D], one row per router output: X = E experts
                                 (sigma-MoE, MoA), E + Z router outputs (Switch with no-op
                                 experts), H·E (SwitchHead with ``shared_selection``), H heads
                                 (MoSA, each head choosing its tokens). Mixture-of-Depths has
                                 one output: ``w_router`` [D], a vector (matrices alone get
                                 weight decay, and an optimizer state saved with it in the
                                 no-decay group must still load).
                                 SwitchHead's two sides: ``w_router_src`` (source side, serves V
                                 and K) and ``w_router_dst`` (destination side, serves O and Q).
                                 A router bias is ``bias_router`` [X] (MoD's single one: [1]).
    stacked expert weights       ``w_<role>`` with the expert (or head) first: the feedforward
                                 MoEs' ``w_in`` [E, D, G], ``w_gate`` [E, D, G] (gated experts)
                                 and ``w_out`` [E, G, D]; the attention projections ``w_q``,
                                 ``w_k``, ``w_v`` [X, D, C] and ``w_o`` [X, C, D] when they are
                                 experts ([D, H·C] / [H·C, D] when dense).
    expert biases                ``bias_in`` [E, G], the hidden bias of each expert; ``bias_out``
                                 [D], the one ungated output bias.

G is the expert's hidden width (sigma-MoE's expert_size, Switch's d_ff). Buffers keep their
own names (``usage*``, ``expert_bias`` of loss-free balancing), as do nn.Linear sub-modules
(``shared_gate.weight``, dense MLPs' ``w1`` / ``w_up``, ...), whose names follow torch's.

The routed experts of the feedforward MoEs live in their ``experts`` sub-module
(moeify.layers.experts): ``experts.w_in`` and so on. Runs whose layers held those weights
themselves (``w_in`` on the layer) still load: the layers register the move with
``rename_legacy_keys`` (a load_state_dict pre-hook), ``upgrade_legacy_keys`` applies it to a
whole model's state dict for code that reads a checkpoint by key before loading it (expert
parallelism), and sharded checkpoints read it too (moeify.rundir.sharded).

No Parameter is 0-dim (FSDP2 shards dim 0 of every parameter): a learned scalar is a vector of
one element, and a state dict that holds it 0-dim (written before) loads through
``load_scalars_as_vectors`` (the attention core's ``scale``, MoD's ``bias_router``); the
optimizer state of such a parameter is reshaped the same way by whoever restores it
(moeify.rundir.checkpoints.reshape_like).

Shape legend: X rows of a selection matrix (one per expert), D d_model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from moeify.ops.aux_losses import balance_from_counts, pooled_entropy_loss
from moeify.ops.dropout import dropout
from moeify.ops.moe import implementations
from moeify.ops.routing import count_selections


ROUTING_KINDS = {"switchhead": "SwitchHead", "moa": "MoA heads", "sigma_moe": "\u03c3-MoE experts",
                 "switch": "Switch experts", "mod": "MoD fraction routed",
                 "moh": "MoH routed heads", "mor": "MoR recursion depths",
                 "remoe": "ReMoE experts"}


class RoutingStats:
    """One routing decision of one layer over one batch (detached, valid tokens only).

    kind:     a key of ROUTING_KINDS.
    counts:   int64 [G, E]: selections per group and expert, counted by
              moeify.ops.routing.count_selections; G = heads for SwitchHead (each head routes
              over its own E experts), 1 otherwise. Mixture-of-Depths: [1, 2] = (skipped, routed).
    gate_sum: float32 []: the sum of the kept gates over the counted selections (None for
              Mixture-of-Depths, whose choice has no gate).
    serves:   the projections a SwitchHead selection serves, sorted (("k", "v"), ("o",), ...).
    n_real:   columns past ``n_real`` are no-op experts (Switch with no-op experts), else None.
    layer:    the block index, set by the model (``with_layer``; None inside a layer).

    Immutable. ``counts`` and ``gate_sum`` are given, or (``routing_record``) counted on first
    read: decoding, which never reads them, skips the counting ops of every record and token.
    """

    __slots__ = ("kind", "serves", "n_real", "layer", "_values")

    def __init__(self, kind: str, counts: torch.Tensor | None, gate_sum: torch.Tensor | None,
                 serves: tuple[str, ...] = (), n_real: int | None = None,
                 layer: int | None = None, *, _values: "_Deferred | None" = None) -> None:
        if (counts is None) == (_values is None):
            raise TypeError("RoutingStats needs counts (or a deferred count), not both")
        init = object.__setattr__
        init(self, "kind", kind)
        init(self, "serves", tuple(serves))
        init(self, "n_real", n_real)
        init(self, "layer", layer)
        init(self, "_values", _values or _Deferred(lambda: (counts, gate_sum)))

    def __setattr__(self, name, value):
        raise AttributeError(f"RoutingStats is immutable (tried to set {name!r})")

    @property
    def counts(self) -> torch.Tensor:
        return self._values.get()[0]

    @property
    def gate_sum(self) -> torch.Tensor | None:
        return self._values.get()[1]

    def with_layer(self, layer: int) -> "RoutingStats":
        """The same record (sharing its counting, done at most once) for block ``layer``."""
        return RoutingStats(self.kind, None, None, self.serves, self.n_real, layer,
                            _values=self._values)

    def __repr__(self) -> str:
        return (f"RoutingStats(kind={self.kind!r}, counts={self.counts!r}, "
                f"gate_sum={self.gate_sum!r}, serves={self.serves!r}, n_real={self.n_real!r}, "
                f"layer={self.layer!r})")

    @property
    def label(self) -> str:
        """The routing kind as analysis names it (SwitchHead: which projections it serves)."""
        if self.kind == "switchhead":
            return f"SwitchHead {'/'.join(p.upper() for p in self.serves)} experts"
        return ROUTING_KINDS[self.kind]

    def real_counts(self) -> torch.Tensor:
        return self.counts if self.n_real is None else self.counts[:, :self.n_real]

    @torch.no_grad()
    def metrics(self) -> dict[str, torch.Tensor]:
        """What training logs per routing decision: the counts, the entropy (nats) of the expert
        usage averaged over groups, the experts with no selection, the mean kept gate
        (Mixture-of-Depths: the counts and the fraction of valid tokens routed)."""
        if self.kind == "mod":
            n = self.counts.sum().clamp_min(1)
            return {"counts": self.counts, "fraction_routed": self.counts[0, 1].float() / n}
        c = self.real_counts()
        c = c.to(torch.float32 if c.device.type == "mps" else torch.float64)  # MPS: no float64
        share = c / c.sum(-1, keepdim=True).clamp_min(1.0)
        entropy = -(share * share.clamp_min(1e-30).log()).sum(-1).mean()
        return {"counts": self.counts, "usage_entropy": entropy.float(),
                "dead_experts": (self.real_counts() == 0).sum(),
                "gate_mean": self.gate_sum / self.counts.sum().clamp_min(1)}


class _Deferred:
    """A value computed by ``fn`` on the first ``get`` and kept (shared by a record's copies)."""

    __slots__ = ("fn", "value")

    def __init__(self, fn) -> None:
        self.fn, self.value = fn, None

    def get(self):
        if self.fn is not None:
            self.value, self.fn = self.fn(), None
        return self.value


def routing_record(kind: str, idx: torch.Tensor, num_experts: int, gates: torch.Tensor,
                   keep: torch.Tensor | None = None, *, groups: int = 1,
                   **facts) -> RoutingStats:
    """The RoutingStats of one selection: ``idx`` / ``gates`` [M, ...] the selected experts (in
    [0, groups · num_experts): group g's expert e is g · num_experts + e) and their gates;
    ``keep`` (broadcastable to idx) False for what is not counted. Counted when first read."""
    def count():
        with torch.no_grad():
            counts = count_selections(idx, groups * num_experts, keep).view(groups, num_experts)
            g = gates.detach().float()
            if keep is not None:
                g = g * keep.expand_as(idx).to(g.dtype)
            return counts, g.sum()

    return RoutingStats(kind, None, None, _values=_Deferred(count), **facts)


@dataclass(frozen=True)
class PooledEntropy:
    """One application's share of a regulariser that pools over every application of a shared
    layer before it is taken (MoEUT's entropy regularisers, moeify.ops.aux_losses
    ``sequence_prob_sums`` / ``pooled_entropy_loss``): per sequence the summed selection
    softmax ``psum`` [B, *X, E] and the valid-token count ``count`` [B]. The model adds the
    shares of one block's applications (``merge``) and takes ``loss`` once, at the end of its
    forward (moeify.models.lm); a layer used alone has one application."""

    coef: float
    psum: torch.Tensor
    count: torch.Tensor

    def merge(self, other: "PooledEntropy") -> "PooledEntropy":
        return PooledEntropy(self.coef, self.psum + other.psum, self.count + other.count)

    def loss(self) -> torch.Tensor:
        return self.coef * pooled_entropy_loss(self.psum, self.count)


@dataclass(frozen=True)
class GlobalBalance:
    """A balance loss whose f_i may come from a larger batch than one forward's: the global-batch
    balance loss (Qiu et al. 2025, arXiv 2501.11873; Switch with ``balance_scope="global"``).
    ``probs`` [E]: the mean router probability over this forward's valid tokens (it carries the
    gradient); ``counts`` [E]: this forward's top-1 counts (float32, no gradient). ``loss()``
    takes f_i from this forward's counts (the per-batch Switch loss); the trainer passes the
    update's counts, every micro-batch and process (moeify.train.balancing). The loss is taken
    outside the layer, so a forward that is run again (activation recomputation) counts
    nothing twice."""

    coef: float
    probs: torch.Tensor
    counts: torch.Tensor

    def loss(self, counts: torch.Tensor | None = None) -> torch.Tensor:
        return self.coef * balance_from_counts(self.probs, self.counts if counts is None
                                               else counts)


@dataclass
class Aux:
    """Auxiliary outputs of a layer, returned (never stored in globals).

    losses:  scalar tensors already multiplied by their coefficients, ready to add to the LM loss
             (a loss is present whenever its coefficient is non-zero).
    stats:   other detached statistics (router entropy, fraction dropped, ...).
    routing: the layer's routing decisions (``RoutingStats``), by name ("src", "dst", "router").
    pooled:  losses not yet taken (``PooledEntropy``): the model pools them over the
             applications of a shared block and adds ``loss()`` to its losses under the same
             name (MoEUT's regularisers).
    balance: losses whose batch statistics a trainer may widen (``GlobalBalance``): the model
             adds ``loss()`` to its losses under the same name and returns the record too.
    """

    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    routing: dict[str, RoutingStats] = field(default_factory=dict)
    pooled: dict[str, PooledEntropy] = field(default_factory=dict)
    balance: dict[str, GlobalBalance] = field(default_factory=dict)

    def update(self, other: "Aux", prefix: str = "") -> "Aux":
        for k, v in other.losses.items():
            self.losses[prefix + k] = v
        for k, v in other.stats.items():
            self.stats[prefix + k] = v
        for k, v in other.routing.items():
            self.routing[prefix + k] = v
        for k, v in other.pooled.items():
            self.pooled[prefix + k] = v
        for k, v in other.balance.items():
            self.balance[prefix + k] = v
        return self

    def total_loss(self) -> torch.Tensor | None:
        """The weighted losses, pooled ones taken over this one application."""
        terms = (list(self.losses.values()) + [p.loss() for p in self.pooled.values()]
                 + [b.loss() for b in self.balance.values()])
        return sum(terms) if terms else None


class Dropout(nn.Dropout):
    """nn.Dropout (same masks, outputs, gradients and state dict) that keeps a bool mask for
    backward instead of a float one where it can (moeify.ops.dropout)."""

    impl: str = "auto"  # "reference": torch's own dropout, as the tests compare against

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, impl=self.impl)


def register_usage(module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
    """Create the running per-expert count buffer ``name``: int64 (so model.to(dtype) leaves it
    exact), not saved in checkpoints."""
    module.register_buffer(name, torch.zeros(shape, dtype=torch.int64), persistent=False)


def accumulate_usage(module: nn.Module, name: str, counts: "torch.Tensor | RoutingStats") -> None:
    """Add ``counts`` (a tensor of the buffer's size, or a routing record's counts) to the
    buffer made by ``register_usage``, in training mode only: evaluation never changes the
    running statistics (nor counts a record nobody reads)."""
    if module.training:
        if isinstance(counts, RoutingStats):
            counts = counts.counts
        buf = getattr(module, name)
        c = counts.detach()
        buf.add_((c.round() if c.is_floating_point() else c).long().view_as(buf))


def record_depth_routing(module: nn.Module, aux: "Aux", kind: str, counts: torch.Tensor,
                         gate_sum: torch.Tensor | None = None) -> None:
    """A depth router's routing record ``aux.routing[kind]`` (counts [1, n]: Mixture-of-Depths'
    (skipped, routed) tokens, Mixture-of-Recursions' tokens by final depth) and the running
    ``usage`` buffer it adds to in training."""
    aux.routing[kind] = RoutingStats(kind, counts.view(1, -1), gate_sum)
    accumulate_usage(module, "usage", counts)


# ----------------------------------------------------------------------------------------------
# Moved state-dict keys.


def rename_legacy_keys(module: nn.Module, renames: dict) -> None:
    """Let ``module`` load state dicts that hold its entries under the keys they had before they
    moved (moeify.layers.experts.EXPERT_KEYS):
    ``renames`` maps an old key (relative to the module) to the current one, or to
    ``(current, fn)`` where the tensor also changed form (``fn(old_tensor)``). Applied by a
    load_state_dict pre-hook, so ``load_state_dict`` of the module or of any model holding it
    (strict or not) reads both. A key is renamed only when its current name is absent: a state
    dict holding both keeps the current one and the old key stays unexpected. Calling it again
    on the same module adds renames."""
    table = module.__dict__.get("_legacy_keys")
    if table is None:
        table = {}
        object.__setattr__(module, "_legacy_keys", table)

        def hook(state_dict, prefix, *args):
            _rename_into(state_dict, prefix, table)

        module._register_load_state_dict_pre_hook(hook)
    table.update(renames)


def _rename_into(state_dict, prefix: str, table: dict) -> None:
    for old, new in table.items():
        fn = None
        if isinstance(new, tuple):
            new, fn = new
        if prefix + old in state_dict and prefix + new not in state_dict:
            value = state_dict.pop(prefix + old)
            state_dict[prefix + new] = value if fn is None else fn(value)


def load_scalars_as_vectors(module: nn.Module, *names: str) -> None:
    """Let ``module`` load a state dict that holds its one-element vectors ``names`` as 0-dim
    tensors (a load_state_dict pre-hook; module docstring)."""
    def hook(state_dict, prefix, *args):
        for n in names:
            t = state_dict.get(prefix + n)
            if isinstance(t, torch.Tensor) and t.dim() == 0:
                state_dict[prefix + n] = t.reshape(1)

    module._register_load_state_dict_pre_hook(hook)


def upgrade_legacy_keys(model: nn.Module, state_dict: dict) -> dict:
    """A copy of ``state_dict`` (a state dict of ``model``, perhaps with moved keys at their old
    places) with every such key renamed as ``model.load_state_dict`` would rename it: for code that
    indexes a checkpoint by the current names before loading it."""
    out = dict(state_dict)
    for name, module in model.named_modules():
        table = module.__dict__.get("_legacy_keys")
        if table:
            _rename_into(out, f"{name}." if name else "", table)
    return out


# ----------------------------------------------------------------------------------------------
# Config checks: ValueError naming the config class, the field and the value.


def _check_ints(cfg, names: tuple[str, ...], low: int, what: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{type(cfg).__name__}.{name} must be {what}, got {value!r}")


def check_positive(cfg, *names: str) -> None:
    """Each field must be a positive int (bool and float are refused: they would fail later)."""
    _check_ints(cfg, names, 1, "a positive integer")


def check_count(cfg, *names: str, note: str = "") -> None:
    """Each field must be an int >= 0 (bool and float are refused); ``note`` says what 0 means."""
    _check_ints(cfg, names, 0, "an integer >= 0" + (f" ({note})" if note else ""))


def check_flag(cfg, *names: str) -> None:
    """Each field must be True or False (not a truthy int or string)."""
    for name in names:
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{type(cfg).__name__}.{name} must be True or False, "
                             f"got {getattr(cfg, name)!r}")


def check_probability(cfg, *names: str) -> None:
    """Each field must lie in [0, 1) (dropout rates)."""
    for name in names:
        value = getattr(cfg, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{type(cfg).__name__}.{name} must lie in [0, 1), got {value}")


def check_nonnegative(cfg, *names: str) -> None:
    """Each field must be >= 0 (loss coefficients: 0 disables the loss)."""
    for name in names:
        value = getattr(cfg, name)
        if not value >= 0:
            raise ValueError(f"{type(cfg).__name__}.{name} must be >= 0 (0 disables the loss), "
                             f"got {value}")


def check_expert_impl(cfg, *, sets: bool = False) -> None:
    """``cfg.expert_impl`` must name a registered kernel (moeify.ops.moe.registry) or "auto";
    "sets" only where the layer routes in groups of experts (``sets=True``: SwitchHead)."""
    allowed = tuple(i for i in implementations() if sets or i != "sets") + ("auto",)
    if cfg.expert_impl not in allowed:
        raise ValueError(f"{type(cfg).__name__}.expert_impl must be one of {allowed}, "
                         f"got {cfg.expert_impl!r}")


def check_token_input(who: str, x_BTD: torch.Tensor, d_model: int,
                      valid_BT: torch.Tensor | None = None) -> None:
    """A layer's input must be [B, T, d_model], and ``valid_BT`` (if given) [B, T]."""
    if x_BTD.dim() != 3 or x_BTD.shape[-1] != d_model:
        raise ValueError(f"{who} expects input [batch, tokens, d_model={d_model}], "
                         f"got {tuple(x_BTD.shape)}")
    if valid_BT is not None and tuple(valid_BT.shape) != tuple(x_BTD.shape[:2]):
        raise ValueError(f"{who}: valid_BT must be [batch, tokens] = "
                         f"{list(x_BTD.shape[:2])}, got {tuple(valid_BT.shape)}")


# ----------------------------------------------------------------------------------------------
# Initialisers.


def init_scale(n_layers: int) -> float:
    """s = sqrt(2 / L), the depth scale of the SwitchHead and sigma-MoE initialisation
    (SwitchHead appendix; sigma-MoE, arXiv 2310.10837, its initialisation)."""
    return math.sqrt(2.0 / n_layers)


def trunc_normal_(w: torch.Tensor, std: float) -> torch.Tensor:
    """Truncated normal at two standard deviations of the untruncated normal ``std`` (the Switch
    initialiser, as Mesh TensorFlow's truncated_normal_initializer: the values' actual standard
    deviation is about 0.88 · std). A fake tensor (shapes without data: the cost contract counts
    whole training steps under them, moeify.bench.contract) is left as it is: torch's truncated
    normal reads values back to reject draws (it skips meta tensors itself)."""
    if is_fake(w):
        return w
    return nn.init.trunc_normal_(w, std=std, a=-2.0 * std, b=2.0 * std)


@torch.no_grad()
def trunc_normal_exact_std_(w: torch.Tensor, std: float) -> torch.Tensor:
    """A standard normal truncated at ±2, rescaled so the drawn values have standard deviation
    exactly ``std``: the SwitchHead authors' trunc_normal_ (framework/utils/init.py of their
    code), which their dense baselines use. A plain truncated normal drawn with std σ has an
    actual std of about 0.88 σ. A fake tensor is left as it is (``trunc_normal_``)."""
    if is_fake(w):
        return w
    nn.init.trunc_normal_(w, std=1.0, a=-2.0, b=2.0)
    return w.mul_(std / w.std())


@torch.no_grad()
def renorm_rows_(w_XD: torch.Tensor) -> torch.Tensor:
    """Rescale every row of a selection matrix to the same L2 norm while keeping the overall
    standard deviation: no expert starts with a larger router norm than another. sigma-MoE's
    expert selection (the authors' ``renorm_keep_std(expert_sel, dim=1)``, in
    github.com/RobertCsordas/moe and in ``SigmaMoE`` of github.com/RobertCsordas/moeut;
    sigma-MoE arXiv 2310.10837)."""
    std = w_XD.std()
    w_XD.div_(w_XD.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    return w_XD.mul_(std / w_XD.std())


@torch.no_grad()
def renorm_rows_keep_row_std_(w_XD: torch.Tensor) -> torch.Tensor:
    """SwitchHead's selection matrices (the authors' ``SwitchHeadCore.renorm_rows`` in
    github.com/RobertCsordas/moeut, moeut.py, the rule of ``renorm_rows`` in
    github.com/RobertCsordas/moe_attention; SwitchHead arXiv 2312.07987): row i becomes its
    unit vector times its own standard deviation sigma_i (unbiased, before the change), the
    whole then divided by the standard deviation of the unit rows. Row norms stay
    proportional to the rows' own spreads (a few percent apart), unlike ``renorm_rows_``."""
    std_X1 = w_XD.std(dim=-1, keepdim=True)
    w_XD.div_(w_XD.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    return w_XD.mul_(std_X1 / w_XD.std())
