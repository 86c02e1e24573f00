"""ModelConfig: what a TransformerLM is made of, per layer, as a frozen and JSON-serialisable value.

Each of ``attention``, ``feedforward`` and ``depth`` is a *repeating pattern*: a tuple of layer
configs, layer i uses entry ``i % len(pattern)``. One config means "every layer"; e.g.
``depth=(None, MoDConfig(...))`` puts Mixture-of-Depths on every other block (the MoD paper's
best setting), ``None`` meaning a plain block.

Layer configs are the frozen dataclasses next to their modules (moeify.layers.*). In JSON every
layer config is a dict with a ``"type"`` tag (its class name), so the trainer can write the
resolved config into a run directory and read it back exactly.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import typing
from dataclasses import dataclass
from typing import Any

from moeify.errors import MoeifyError
from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.common import check_count, check_flag, check_positive, check_probability
from moeify.layers.feedforward import SigmaMoEConfig
from moeify.layers.gqa import GroupedQueryAttentionConfig
from moeify.layers.norm import NormConfig
from moeify.layers.recursion import MoRConfig
from moeify.layers.switchhead import SwitchHeadConfig
from moeify.models.lm import TransformerLM

# Modules whose dataclasses may appear in a ModelConfig; a type tag is looked up in these.
LAYER_CONFIG_MODULES = (
    "moeify.layers.attention",
    "moeify.layers.switchhead",
    "moeify.layers.moa",
    "moeify.layers.feedforward",
    "moeify.layers.depth",
    "moeify.layers.gqa",
    "moeify.layers.mlp",
    "moeify.layers.norm",
    "moeify.layers.mosa",
    "moeify.layers.moh",
    "moeify.layers.recursion",
)

# Fields written to JSON only when they differ from their default, so that the model.json and
# checkpoint records of models without them read exactly as before these options existed.
OPTIONAL_FIELDS = ("norm", "max_positions", "tie_embeddings", "output_bias", "group_size",
                   "block", "recursion")
BLOCKS = ("pre_ln", "peri_ln")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only language model (SwitchHead appendix).

    vocab_size:     tokens in the vocabulary (8000 BPE for the paper's text presets).
    d_model:        residual width d.
    n_layers:       number of blocks L (every layer config's ``n_layers`` must equal it: the
                    s = sqrt(2 / L) initialisation depends on it).
    context_length: chunk length T: tokens per training sequence (and XL memory length).
    attention:      attention config(s): DenseAttentionConfig, SwitchHeadConfig, MoAConfig.
    feedforward:    feedforward config(s): DenseFFConfig, SigmaMoEConfig, SwitchFFConfig,
                    ReMoEConfig.
    depth:          depth routing per block: None (plain block) or MoDConfig.
    xl_memory:      carry the previous chunk's block inputs as memory (Transformer-XL).
    dropout:        on the embeddings, the residual branches and before the output layer
                    (the layers' own configs hold their inner dropout).
    norm:           the blocks' and the final normalisation (NormConfig: LayerNorm with bias,
                    eps 1e-5 by default; RMSNorm for the Llama family).
    max_positions:  > 0 adds a learned absolute position embedding of that many positions to the
                    token embedding (GPT-2); 0 = none (positions come from the attention).
    tie_embeddings: the output layer reuses the token embedding matrix (no bias then).
    output_bias:    the untied output layer has a bias (the papers' models) or not.
    group_size:     MoEUT's layer grouping G: 0 = every layer has its own weights; G > 0
                    (dividing n_layers) builds G blocks and applies them in order n_layers / G
                    times, block i using the weights of block i mod G (G = 1: a universal
                    Transformer). Each application keeps its own KV cache and XL memory.
    block:          "pre_ln" (the papers' pre-LN block, layers/block.py) or "peri_ln" (MoEUT's
                    peri-layernorm, layers/moeut.py; SwitchHead attention, sigma-MoE
                    feedforward, no XL memory).
    recursion:      None, or a MoRConfig (Mixture-of-Recursions, layers/recursion.py): the
                    layers between the unshared first and last (Middle-Cycle; all layers with
                    Cycle sharing) are N_r repetitions of one shared stack whose first
                    (n_layers - 2) / N_r layer configs build it, and a router picks each
                    token's number of repetitions. No XL memory, group_size or depth routing.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    context_length: int
    attention: Any
    feedforward: Any
    depth: Any = None
    xl_memory: bool = True
    dropout: float = 0.0
    norm: NormConfig = NormConfig()
    max_positions: int = 0
    tie_embeddings: bool = False
    output_bias: bool = True
    group_size: int = 0
    block: str = "pre_ln"
    recursion: Any = None

    def __post_init__(self) -> None:
        check_positive(self, "vocab_size", "d_model", "n_layers", "context_length")
        check_probability(self, "dropout")
        if not isinstance(self.norm, NormConfig):
            raise ValueError(f"ModelConfig.norm must be a NormConfig, got {self.norm!r}")
        check_count(self, "max_positions", note="0: no learned position embedding")
        check_flag(self, "tie_embeddings", "output_bias")
        if self.tie_embeddings and self.output_bias:
            raise ValueError("ModelConfig: a tied output layer has no bias; set "
                             "output_bias=False with tie_embeddings=True")
        check_flag(self, "xl_memory")
        for name in ("attention", "feedforward", "depth"):
            object.__setattr__(self, name, self._pattern(name, getattr(self, name)))
        self._check_grouping()
        self._check_recursion()
        if self.xl_memory and any(d is not None for d in self.depth):
            # The memory would hold tokens a routed block never saw (layers/depth.py).
            raise ValueError("depth routing (Mixture-of-Depths) cannot be combined with XL "
                             "memory; set xl_memory=False and use RoPE attention")

    def _check_grouping(self) -> None:
        G = self.group_size
        if isinstance(G, bool) or not isinstance(G, int) or G < 0 or (G and self.n_layers % G):
            raise ValueError(f"ModelConfig.group_size must be 0 (no sharing) or a divisor of "
                             f"n_layers={self.n_layers}, got {G!r}")
        for name in ("attention", "feedforward", "depth"):
            if G and G % len(getattr(self, name)):
                raise ValueError(f"ModelConfig.{name} has a pattern of "
                                 f"{len(getattr(self, name))} configs, which does not divide "
                                 f"group_size={G}: the shared blocks repeat every G layers")
        if self.block not in BLOCKS:
            raise ValueError(f"ModelConfig.block must be one of {BLOCKS}, got {self.block!r}")
        if self.block == "peri_ln":
            if not all(isinstance(a, SwitchHeadConfig) for a in self.attention) or not all(
                    isinstance(f, SigmaMoEConfig) for f in self.feedforward):
                raise ValueError("block='peri_ln' (MoEUT) needs SwitchHeadConfig attention and "
                                 "SigmaMoEConfig feedforwards (their inputs are split between "
                                 "LN(x) and x); use block='pre_ln' for other layers")
            if self.xl_memory:
                raise ValueError("block='peri_ln' (MoEUT) takes no XL memory; set "
                                 "xl_memory=False and use RoPE attention")

    def _check_recursion(self) -> None:
        mor = self.recursion
        if mor is None:
            return
        if not isinstance(mor, MoRConfig):
            raise ValueError(f"ModelConfig.recursion must be None or a MoRConfig, got {mor!r}")
        if mor.d_model != self.d_model:
            raise ValueError(f"ModelConfig.recursion has d_model={mor.d_model} but the model has "
                             f"d_model={self.d_model}; make them equal")
        mor.stack_layers(self.n_layers)  # ValueError when the depth does not split
        if self.xl_memory or self.group_size or any(d is not None for d in self.depth):
            raise ValueError("Mixture-of-Recursions (ModelConfig.recursion) takes no XL memory, "
                             "group_size or depth routing: set xl_memory=False (RoPE "
                             "attention), group_size=0 and depth=None")
        if mor.kv_sharing and not all(isinstance(a, (DenseAttentionConfig,
                                                     GroupedQueryAttentionConfig))
                                      for a in self.attention_layers()):
            raise ValueError("recursive KV sharing (MoRConfig.kv_sharing) is built and costed "
                             "for dense and grouped-query attention; use one of them, or "
                             "kv_sharing=False")

    @property
    def n_blocks(self) -> int:
        """Distinct blocks (parameter sets): group_size, or n_layers without sharing."""
        return self.group_size or self.n_layers

    def _pattern(self, name: str, value: Any) -> tuple:
        pattern = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if not 1 <= len(pattern) <= self.n_layers:
            raise ValueError(f"ModelConfig.{name} must hold between 1 and n_layers="
                             f"{self.n_layers} configs (a pattern repeated over the layers), "
                             f"got {len(pattern)}")
        for i, cfg in enumerate(pattern):
            if cfg is None:
                if name != "depth":
                    raise ValueError(f"ModelConfig.{name}[{i}] is None; every layer needs an "
                                     f"{name} config (only depth may be None)")
                continue
            if not dataclasses.is_dataclass(cfg) or not hasattr(cfg, "build"):
                raise ValueError(f"ModelConfig.{name}[{i}] must be a layer config dataclass with "
                                 f"build() (e.g. from moeify.layers), got {type(cfg).__name__}")
            d = getattr(cfg, "d_model", self.d_model)
            if d != self.d_model:
                raise ValueError(f"ModelConfig.{name}[{i}] ({type(cfg).__name__}) has d_model={d}"
                                 f" but the model has d_model={self.d_model}; make them equal")
            L = getattr(cfg, "n_layers", self.n_layers)
            if L != self.n_layers:
                raise ValueError(f"ModelConfig.{name}[{i}] ({type(cfg).__name__}) has n_layers="
                                 f"{L} but the model has n_layers={self.n_layers}; the "
                                 "initialisation scale sqrt(2/L) needs the model depth there")
        return pattern

    # ------------------------------------------------------------------ per-layer view

    @property
    def T(self) -> int:
        return self.context_length

    def attention_layers(self) -> list[Any]:
        return [self.attention[i % len(self.attention)] for i in range(self.n_layers)]

    def feedforward_layers(self) -> list[Any]:
        return [self.feedforward[i % len(self.feedforward)] for i in range(self.n_layers)]

    def depth_layers(self) -> list[Any]:
        return [self.depth[i % len(self.depth)] for i in range(self.n_layers)]

    def build(self):
        """The TransformerLM this config describes."""
        return TransformerLM(self)

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in OPTIONAL_FIELDS and v == f.default:
                continue
            out[f.name] = [_encode(c) for c in v] if f.name in ("attention", "feedforward",
                                                                "depth") else _encode(v)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        kwargs = known_fields(cls, data)
        for name in ("attention", "feedforward", "depth"):
            if name in kwargs and not isinstance(kwargs[name], tuple):
                kwargs[name] = (kwargs[name],)  # one layer config for every layer
        return cls(**kwargs)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))


# ---------------------------------------------------------------------- dict -> dataclass

def field_hints(cls: type) -> dict[str, Any]:
    """The resolved type annotations of a dataclass ({} when they cannot be resolved, e.g. a
    name imported only under TYPE_CHECKING)."""
    try:
        return typing.get_type_hints(cls, vars(importlib.import_module(cls.__module__)))
    except Exception:
        return {}


def known_fields(cls: type, data: Any) -> dict[str, Any]:
    """``data`` as the keyword arguments of dataclass ``cls``: a dict whose keys are all fields
    of ``cls`` (ValueError naming the unknown ones), JSON lists turned back into the container
    type each field is annotated with."""
    if not isinstance(data, dict):
        raise ValueError(f"a {cls.__name__} dict is expected, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}; known: {sorted(known)}")
    hints = field_hints(cls)
    return {k: _decode_field(v, hints.get(k)) for k, v in data.items()}


# ---------------------------------------------------------------------- layer-config codec

def layer_config_class(tag: str) -> type:
    """The layer config dataclass named ``tag`` in one of LAYER_CONFIG_MODULES. A module that
    fails to import is named in the error when ``tag`` is found nowhere else (it may be the one
    that defines it), never taken for a module without it."""
    broken = []
    for mod_name in LAYER_CONFIG_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            broken.append(f"{mod_name} failed to import ({type(e).__name__}: {e})")
            continue
        cls = getattr(mod, tag, None)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            return cls
    if broken:
        raise MoeifyError(f"cannot read layer config type {tag!r}: {'; '.join(broken)}; fix "
                          "that module (or the installation) and try again")
    raise ValueError(f"unknown layer config type {tag!r}; expected a config class from one of "
                     f"{', '.join(LAYER_CONFIG_MODULES)}")


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {"type": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = _encode(getattr(value, f.name))
        return out
    if isinstance(value, (set, frozenset)):
        return sorted(_encode(v) for v in value)
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    raise ValueError(f"cannot write a {type(value).__name__} ({value!r}) to JSON")


def _decode(value: Any) -> Any:
    if not isinstance(value, dict) or "type" not in value:
        return value
    cls = layer_config_class(value["type"])
    return cls(**known_fields(cls, {k: v for k, v in value.items() if k != "type"}))


def _decode_field(value: Any, hint: Any) -> Any:
    """Turn JSON lists back into the container type the field is annotated with."""
    if isinstance(value, dict):
        return _decode(value)
    if not isinstance(value, list):
        return value
    origins = {typing.get_origin(hint) or hint}
    for arg in typing.get_args(hint):  # Optional[...] / unions
        origins.add(typing.get_origin(arg) or arg)
    items = [_decode(v) for v in value]
    if frozenset in origins:
        return frozenset(items)
    if set in origins:
        return set(items)
    if list in origins:
        return items
    return tuple(items)
