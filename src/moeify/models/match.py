"""Parameter matching (SwitchHead §3): turn a dense baseline into a SwitchHead (or MoA) model
with (slightly) fewer attention parameters and a feedforward that absorbs the remainder.

The procedure, which reproduces the paper's Table 9 choices:

1. d_head: the largest multiple of ``d_head_multiple`` (4) for which the new attention layer has
   at most as many parameters as the dense one. This gives every d_head of Table 9 and Table 6
   (76, 132, 112, 112, 64, 100; 112 / 56 / 48 for the expert subsets).
2. d_ff: the exact width d_ff* that would equalise the per-layer parameter count is rounded the
   way the authors' configs express widths, as ``ff_multiplier = d_ff / d_model`` with two
   decimals, then d_ff = int(d_model · ff_multiplier). This gives 2080, 4147, 4188, 2092 and
   4136 exactly; enwik8 (2094 vs 2088) and some Table 6 rows (within 4: the paper reused 2080
   for every d_head = 76 row, whatever its number of selection matrices) differ slightly, as
   the paper's own totals only match "within about 0.05%".

For MoA (E = 10 at WT103 47M) the same d_head rule gives 88, the value Table 1's printed MACs
imply.

Parameter counts come from the real modules built on the meta device (no weights allocated).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.feedforward import DenseFFConfig
from moeify.models.builders import moa_attn, switchhead_attn
from moeify.models.config import ModelConfig
from moeify.models.params import layer_parameters, model_parameters

KINDS = ("switchhead", "moa")


@dataclass(frozen=True)
class MatchResult:
    """The matched model and how close it lands. ``*attention_params`` count one block's
    attention layer (dense baseline and new); ``dense_params`` and ``params`` whole models."""

    config: ModelConfig
    d_head: int
    d_ff: int
    ff_multiplier: float
    dense_attention_params: int
    attention_params: int
    dense_params: int
    params: int

    @property
    def difference(self) -> int:
        return self.params - self.dense_params

    @property
    def relative_difference(self) -> float:
        return self.difference / self.dense_params

    def to_dict(self) -> dict[str, Any]:
        return {"d_head": self.d_head, "d_ff": self.d_ff, "ff_multiplier": self.ff_multiplier,
                "dense_attention_params": self.dense_attention_params,
                "attention_params": self.attention_params, "dense_params": self.dense_params,
                "params": self.params, "difference": self.difference,
                "relative_difference": self.relative_difference}


def _new_attention(dense_attn, kind: str, *, d_head: int, n_heads: int, n_experts: int,
                   k: int | None, experts, shared_selection: bool):
    d, L, pos = dense_attn.d_model, dense_attn.n_layers, dense_attn.pos
    if kind == "switchhead":
        return switchhead_attn(d=d, L=L, H=n_heads, d_h=d_head, E=n_experts, k=k, pos=pos,
                               experts=tuple(experts), shared_selection=shared_selection)
    return moa_attn(d=d, L=L, H=n_heads, d_h=d_head, E=n_experts, pos=pos)


def match_attention(
    dense: ModelConfig,
    *,
    n_heads: int,
    n_experts: int,
    k: int | None = None,
    kind: str = "switchhead",
    experts: tuple[str, ...] = ("v", "o"),
    shared_selection: bool = False,
    d_head: int | None = None,
    d_head_multiple: int = 4,
) -> MatchResult:
    """Replace the attention of the dense model ``dense`` by SwitchHead (H = ``n_heads``,
    E = ``n_experts``, top-``k``) or MoA (``n_heads`` selected heads of ``n_experts``; ``k``
    must be None or equal ``n_heads``), choosing d_head (unless given) and d_ff by §5."""
    dense_attn, dense_ff = _check_match(dense, kind=kind, n_heads=n_heads, k=k,
                                        d_head_multiple=d_head_multiple)

    def attn(dh: int):
        return _new_attention(dense_attn, kind, d_head=dh, n_heads=n_heads,
                              n_experts=n_experts, k=k, experts=experts,
                              shared_selection=shared_selection)

    # Step 1: the largest d_head whose attention has at most the dense one's parameters.
    target = layer_parameters(dense_attn)
    if d_head is None:
        d_head = _largest_d_head(lambda dh: layer_parameters(attn(dh)), target,
                                 d_head_multiple)
    new_attn = attn(d_head)
    new_attn_params = layer_parameters(new_attn)
    # Step 2: the feedforward absorbs the difference.
    d_ff, mult_100 = _matched_d_ff(dense, dense_ff, target - new_attn_params)
    config = dataclasses.replace(dense, attention=(new_attn,),
                                 feedforward=(dataclasses.replace(dense_ff, d_ff=d_ff),))
    return MatchResult(config=config, d_head=d_head, d_ff=d_ff, ff_multiplier=mult_100 / 100,
                       dense_attention_params=target, attention_params=new_attn_params,
                       dense_params=model_parameters(dense)["total"],
                       params=model_parameters(config)["total"])


def _check_match(dense: ModelConfig, *, kind: str, n_heads: int, k: int | None,
                 d_head_multiple: int):
    """The dense baseline's (attention, feedforward) configs, after checking the arguments."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if len(dense.attention) != 1 or len(dense.feedforward) != 1:
        raise ValueError("matching needs a dense model with one attention and one feedforward "
                         "config for every layer (no repeating pattern)")
    dense_attn, dense_ff = dense.attention[0], dense.feedforward[0]
    if not isinstance(dense_attn, DenseAttentionConfig):
        raise ValueError(f"the baseline must have dense attention, got "
                         f"{type(dense_attn).__name__}")
    if not isinstance(dense_ff, DenseFFConfig):
        raise ValueError(f"the baseline must have a dense feedforward (its d_ff absorbs the "
                         f"difference), got {type(dense_ff).__name__}")
    if kind == "switchhead" and k is None:
        raise ValueError("SwitchHead matching needs k (active experts per head)")
    if kind == "moa" and k not in (None, n_heads):
        raise ValueError(f"for MoA the number of selected heads is its k: pass n_heads={k} "
                         f"or leave k unset (got n_heads={n_heads}, k={k})")
    if d_head_multiple < 1:
        raise ValueError(f"d_head_multiple must be a positive integer, got {d_head_multiple}")
    return dense_attn, dense_ff


def _matched_d_ff(dense: ModelConfig, dense_ff, freed: int) -> tuple[int, int]:
    """(d_ff, ff_multiplier in hundredths): the feedforward width that gives back ``freed``
    parameters per layer, rounded as the authors' configs write widths (module docstring)."""
    # Parameters of the feedforward are affine in d_ff: measure the slope.
    f0 = layer_parameters(dense_ff)
    slope = layer_parameters(dataclasses.replace(dense_ff, d_ff=dense_ff.d_ff + 1)) - f0
    d_ff_exact = dense_ff.d_ff + freed / slope
    d = dense.d_model
    mult_100 = round(d_ff_exact * 100 / d)  # ff_multiplier with two decimals, in hundredths
    d_ff = d * mult_100 // 100
    if d_ff < 1:
        raise ValueError(f"the new attention has {-freed} more parameters "
                         "per layer than a whole feedforward can give back; lower n_heads, "
                         "n_experts or d_head")
    return d_ff, mult_100


def _largest_d_head(params_of, target: int, step: int) -> int:
    """The largest multiple of ``step`` with params_of(d_head) <= target (params_of increases
    with d_head): exponential then binary search over multiples of ``step``."""
    if params_of(step) > target:
        raise ValueError(f"even d_head={step} gives more attention parameters "
                         f"({params_of(step)}) than the dense baseline ({target}); use fewer "
                         "heads or experts")
    lo, hi = 1, 2  # in units of step: params_of(lo·step) <= target
    while params_of(hi * step) <= target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if params_of(mid * step) <= target:
            lo = mid
        else:
            hi = mid
    return lo * step
