"""Upcycling: a trained dense TransformerLM -> a Mixture-of-Experts one that starts from its
weights ("sparse upcycling", Komatsuzaki et al., ICLR 2023).

    upcycle(model, attention="switchhead:E=4,k=2", feedforward="sigma-moe:E=8,k=2",
            depth="mod:blocks=1,3,capacity=0.5") -> TransformerLM

Any one or more of the three. Each conversion is a function of one dense layer, in its own
module, whose docstring states what it preserves; the options of a spec are its keywords:

    attention   switchhead:E=,k=(E),experts=(vo),router_scale=(0.1),seed=(0)   attention.py
                moa:k=,kv_head=(0),router_scale=(0.1),seed=(0)
                moh:shared=,k=,router=(learned|query_norm),router_scale=(0.1),
                    balance_coef=(0.01),seed=(0)
    feedforward sigma-moe:E=,k=(E),split=(cluster|contiguous),router=(keys|random),
                          router_scale=(0.1),entropy_coef=(1e-4),seed=(0)      feedforward.py
                switch:E=,k=(1),noise=(0),reinit=(0),router_scale=(0.01),
                       capacity_factor=(1.25),eval_capacity_factor=(2),dropless=(true),seed=(0)
    depth       mod:blocks=(1,3,...),capacity=(0.125),router_scale=(0.1),aux_coef=(0.01),
                    causal_router=(aux_bce),seed=(0)                            depth.py

Exact at conversion (the logits of the dense model, to float32 rounding): sigma-moe with k = E
and router_scale = 0; switch with router_scale = 0 and dropless (the default); mod with capacity = 1 and
router_scale = 0; moh with k = heads - shared and router_scale = 0 (or router=query_norm).
SwitchHead and MoA are not function-preserving (attention.py says what they keep). Imported
checkpoints: their two-layer MLPs (MLPConfig, GPT-2's GELU) convert like the ReLU MLP, into
experts of the same activation, and their multi-head attention to SwitchHead or MoH; grouped-query
attention converts to MoH only; gated MLPs are refused (feedforward.py, attention.py). Layer i draws its
random numbers from ``seed + i``. The embedding, LayerNorms and output
layer are copied; the source model is not modified.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from torch import nn

from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.feedforward import DenseFFConfig
from moeify.layers.gqa import GroupedQueryAttentionConfig
from moeify.layers.mlp import MLPConfig
from moeify.models.config import ModelConfig
from moeify.models.upcycle.attention import to_moa, to_moh, to_switchhead
from moeify.models.upcycle.common import Spec, parse_spec, positive_int, take_options
from moeify.models.upcycle.depth import to_mod
from moeify.models.upcycle.feedforward import GATED_MLP, to_sigma_moe, to_switch

__all__ = ["Spec", "parse_spec", "upcycle", "upcycle_layers", "check_dense", "is_exact",
           "to_switchhead", "to_moa", "to_moh", "to_sigma_moe", "to_switch", "to_mod"]

# kind -> (conversion, required options, defaults); "E" is the conversion's n_experts.
ATTENTION = {
    "switchhead": (to_switchhead, ("E",), {"k": None, "experts": "vo", "router_scale": 0.1,
                                           "seed": 0}),
    "moa": (to_moa, ("k",), {"kv_head": 0, "router_scale": 0.1, "seed": 0}),
    "moh": (to_moh, ("shared", "k"), {"router": "learned", "router_scale": 0.1,
                                      "balance_coef": 0.01, "seed": 0}),
}
FEEDFORWARD = {
    "sigma-moe": (to_sigma_moe, ("E",), {"k": None, "split": "cluster", "router": "keys",
                                         "router_scale": 0.1, "entropy_coef": 1e-4, "seed": 0}),
    "switch": (to_switch, ("E",), {"k": 1, "noise": 0.0, "reinit": 0.0, "router_scale": 0.01,
                                   "capacity_factor": 1.25, "eval_capacity_factor": 2.0,
                                   "dropless": True, "seed": 0}),
}
DEPTH = {
    "mod": (to_mod, (), {"blocks": None, "capacity": 0.125, "router_scale": 0.1,
                         "aux_coef": 0.01, "causal_router": "aux_bce", "seed": 0}),
}


MOE_CONFIGS = ("SwitchHeadConfig", "MoAConfig", "SigmaMoEConfig", "SwitchFFConfig",
               "MoSAConfig", "MoHConfig")


# Dense components that no conversion takes, and why (named in the error).
NOT_CONVERTED = {
    "GatedMLPConfig": GATED_MLP,
}


def check_dense(config: ModelConfig, *, attention: bool = True, feedforward: bool = True) -> None:
    """Refuse a model that already has experts or depth routing (upcycling starts from a dense
    one), and a layer to convert that is not of a kind the conversions take: the papers'
    multi-head attention (DenseAttentionConfig), imported attention (GroupedQueryAttentionConfig:
    SwitchHead takes its multi-head form, attention.py), the papers' ReLU MLP (DenseFFConfig) and
    an imported two-layer MLP (MLPConfig, e.g. GPT-2's GELU MLP). Other dense components (gated
    MLPs...) are not converted; they may stay as they are beside a converted part."""
    if config.group_size or config.block != "pre_ln":
        # No conversion maps per-layer dense weights onto G shared blocks: which layer's
        # weights a shared block would take is a choice, not a function-preserving conversion.
        raise ValueError("upcycling does not apply to shared-layer (MoEUT: group_size, "
                         "peri_ln) models; upcycle a model with group_size=0 and "
                         "block='pre_ln'")
    if config.recursion is not None:
        raise ValueError("upcycling does not apply to Mixture-of-Recursions models (their "
                         "layers are already shared); upcycle a model with recursion=None")
    for name, dense, convert in (("attention", (DenseAttentionConfig,
                                               GroupedQueryAttentionConfig), attention),
                                 ("feedforward", (DenseFFConfig, MLPConfig), feedforward)):
        for i, cfg in enumerate(getattr(config, f"{name}_layers")()):
            kind = type(cfg).__name__
            if kind in MOE_CONFIGS:
                raise ValueError(f"the source is not a dense model: layer {i} {name} is {kind}; "
                                 "upcycle a dense model")
            if convert and not isinstance(cfg, dense):
                why = NOT_CONVERTED.get(kind, f"the {name} conversions take "
                                        f"{' or '.join(d.__name__ for d in dense)} layers only")
                raise ValueError(f"cannot convert layer {i} {name} ({kind}): {why}; leave the "
                                 f"{name} dense (drop that conversion)")
    if any(d is not None for d in config.depth):
        raise ValueError("the source is not a dense model: it already has Mixture-of-Depths "
                         "blocks; upcycle a model without depth routing")


def _resolve(spec: Any, table: dict, what: str) -> tuple[Any, dict[str, Any]] | None:
    if spec is None:
        return None
    spec = parse_spec(spec, what)
    if spec.kind not in table:
        raise ValueError(f"{what}: unknown conversion {spec.kind!r}; choose one of "
                         f"{', '.join(table)}")
    fn, required, defaults = table[spec.kind]
    opts = take_options(spec, what, defaults, required)
    if "E" in opts:
        opts["n_experts"] = positive_int(opts.pop("E"), "E", f"{what} {spec.kind}")
    if opts.get("k") is not None:
        opts["k"] = positive_int(opts["k"], "k", f"{what} {spec.kind}")
    if not isinstance(opts.get("seed", 0), int):
        raise ValueError(f"{what} {spec.kind}: seed must be an integer, got {opts['seed']!r}")
    return fn, opts


def is_exact(attention: Any = None, feedforward: Any = None, depth: Any = None, *,
             source: ModelConfig | None = None) -> bool:
    """Whether these conversions are stated to reproduce the dense model's function exactly.
    MoH is exact when every routed head is kept (k = heads - shared, in every layer of the
    ``source`` model) with a zero or query-norm router."""
    checks = []
    if attention is not None:
        s = parse_spec(attention, "attention")
        o = s.options
        checks.append(s.kind == "moh" and source is not None
                      and (o.get("router") == "query_norm" or o.get("router_scale") == 0)
                      and all(o.get("k") == a.n_heads - o.get("shared", -1)
                              for a in source.attention_layers()))
    if feedforward is not None:
        s = parse_spec(feedforward, "feedforward")
        o = s.options
        if s.kind == "sigma-moe":
            checks.append(o.get("k", o.get("E")) == o.get("E") and o.get("router_scale") == 0)
        else:
            checks.append(o.get("router_scale") == 0 and o.get("dropless", True) is True
                          and not o.get("noise") and not o.get("reinit"))
    if depth is not None:
        o = parse_spec(depth, "depth").options
        checks.append(o.get("capacity") in (1, 1.0) and o.get("router_scale") == 0)
    return bool(checks) and all(checks)


def _mod_blocks(opts: dict[str, Any], n_layers: int) -> list[int]:
    blocks = opts.pop("blocks")
    if blocks is None:
        return list(range(1, n_layers, 2))  # MoD's best: every other block (Raposo et al. §4)
    blocks = blocks if isinstance(blocks, list) else [blocks]
    bad = [b for b in blocks if isinstance(b, bool) or not isinstance(b, int)
           or not 0 <= b < n_layers]
    if bad or len(set(blocks)) != len(blocks):
        raise ValueError(f"depth mod: blocks must be distinct block indices in [0, {n_layers - 1}]"
                         f", got {blocks}")
    return sorted(blocks)


def upcycle_layers(model: nn.Module, *, attention: Any = None, feedforward: Any = None,
                   depth: Any = None) -> tuple[ModelConfig, list[nn.Module]]:
    """The converted ModelConfig and its blocks (sharing no tensor with ``model``)."""
    cfg: ModelConfig = model.config
    check_dense(cfg, attention=attention is not None, feedforward=feedforward is not None)
    att = _resolve(attention, ATTENTION, "attention")
    ff = _resolve(feedforward, FEEDFORWARD, "feedforward")
    dep = _resolve(depth, DEPTH, "depth")
    if att is None and ff is None and dep is None:
        raise ValueError("name at least one conversion: attention, feedforward or depth")
    routed: list[int] = []
    if dep is not None:
        if cfg.xl_memory:
            raise ValueError("depth mod: Mixture-of-Depths needs a model without XL memory "
                             "(xl_memory=False, RoPE attention); this model keeps XL memory")
        routed = _mod_blocks(dep[1], cfg.n_layers)
    blocks = []
    for i, block in enumerate(model.blocks):
        new = copy.deepcopy(block)
        for slot, conv in (("attention", att), ("feedforward", ff)):
            if conv is not None:
                fn, opts = conv
                setattr(new, slot, fn(getattr(block, slot), **{**opts, "seed": opts["seed"] + i}))
        if i in routed:
            fn, opts = dep
            new = fn(new, d_model=cfg.d_model, n_layers=cfg.n_layers,
                     **{**opts, "seed": opts["seed"] + i})
        blocks.append(new)
    new_cfg = dataclasses.replace(
        cfg, attention=_pattern([_inner(b).attention.config for b in blocks]),
        feedforward=_pattern([_inner(b).feedforward.config for b in blocks]),
        depth=_pattern([b.config if hasattr(b, "block") else None for b in blocks]))
    return new_cfg, blocks


def _inner(block: nn.Module) -> nn.Module:
    return block.block if hasattr(block, "block") else block


def _pattern(per_layer: list) -> tuple:
    """The shortest repeating pattern: one entry when every layer is the same."""
    return (per_layer[0],) if all(c == per_layer[0] for c in per_layer) else tuple(per_layer)


def upcycle(model: nn.Module, *, attention: Any = None, feedforward: Any = None,
            depth: Any = None) -> nn.Module:
    """A new TransformerLM: ``model`` (dense, unchanged) with the named conversions applied to
    every layer (depth: to the chosen blocks). Specs are strings ``kind:key=value,...`` or
    ``Spec`` values; see the module docstring."""
    new_cfg, blocks = upcycle_layers(model, attention=attention, feedforward=feedforward,
                                     depth=depth)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("blocks.")}
    for i, block in enumerate(blocks):
        state.update({f"blocks.{i}.{k}": v for k, v in block.state_dict().items()})
    out = new_cfg.build()
    out.load_state_dict(state, strict=True)
    return out.to(next(model.parameters()).device).train(model.training)
