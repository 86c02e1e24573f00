"""The one mapping between moeify models and Hugging Face checkpoints, per family: which
architecture class each ``model_type`` is, the activation and RoPE names, every structural
config.json key as a ``Key`` row (moeify field, Hugging Face key, default, transform) and every
tensor as a ``Link`` (moeify names, Hugging Face names, transform). Import
(moeify.interop.hf_import) reads each row and link one way and the native export
(moeify.interop.hf_native) the other, so an import followed by an export gives back the
checkpoint's structure and tensors: each transform's two directions are inverse by construction
(``config_from_hf`` / ``config_to_hf``, ``to_hf`` / ``from_hf`` below).

    same     one tensor, same layout
    t        one tensor transposed (GPT-2's Conv1D keeps [in, out]; torch's Linear [out, in])
    cat_t    several moeify matrices, transposed and side by side in one Hugging Face tensor
             (GPT-2's c_attn = [W_q^T | W_k^T | W_v^T]); equal widths
    cat      several moeify vectors end to end in one (GPT-2's c_attn bias)
    stack_t  one moeify [E, a, b] expert tensor <-> E Hugging Face matrices [b, a] (the
             per-expert layout save_pretrained writes; moeify stacks them as [E, D, F])
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moeify.errors import MoeifyError
from moeify.layers.attention_core import RopeScaling
from moeify.ops.positional import ROPE_TYPES

MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                     "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
DENSE_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                       "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# model_type -> transformers' class: what import accepts and what the native export writes.
ARCHITECTURES = {**DENSE_ARCHITECTURES, **MOE_ARCHITECTURES}
DENSE_TYPES, MOE_TYPES = tuple(DENSE_ARCHITECTURES), tuple(MOE_ARCHITECTURES)

# (moeify activation, Hugging Face name): GPT-2's activation_function and the Llama family's
# hidden_act. Import also reads the aliases (another name of the same function).
GPT2_ACTIVATIONS = (("gelu_tanh", "gelu_new"), ("gelu", "gelu"), ("relu", "relu"),
                    ("silu", "silu"))
GPT2_ACTIVATION_ALIASES = {"gelu_pytorch_tanh": "gelu_tanh"}
LLAMA_ACTIVATIONS = (("silu", "silu"), ("gelu", "gelu"), ("gelu_tanh", "gelu_pytorch_tanh"),
                     ("relu", "relu"))


def activation_from_hf(name: str, gpt2: bool) -> str | None:
    """moeify's activation for a Hugging Face name (None: not supported)."""
    table = dict((h, m) for m, h in (GPT2_ACTIVATIONS if gpt2 else LLAMA_ACTIVATIONS))
    if gpt2:
        table.update(GPT2_ACTIVATION_ALIASES)
    return table.get(name)


def activation_to_hf(name: str, gpt2: bool) -> str | None:
    """The Hugging Face name of a moeify activation (None: no native form)."""
    return dict(GPT2_ACTIVATIONS if gpt2 else LLAMA_ACTIVATIONS).get(name)


def hf_activation_names(gpt2: bool) -> list[str]:
    names = [h for _, h in (GPT2_ACTIVATIONS if gpt2 else LLAMA_ACTIVATIONS)]
    return names + (list(GPT2_ACTIVATION_ALIASES) if gpt2 else [])


# ---------------------------------------------------------------------- RoPE

# RopeScaling field <- rope_parameters key (transformers' names), per scaled rope_type.
_ROPE_KEYS = {"factor": "factor", "original_context": "original_max_position_embeddings",
              "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
              "beta_fast": "beta_fast", "beta_slow": "beta_slow",
              "attention_factor": "attention_factor", "mscale": "mscale",
              "mscale_all_dim": "mscale_all_dim", "truncate": "truncate"}
_ROPE_FIELDS = {"linear": ("factor",), "dynamic": ("factor", "original_context"),
                "llama3": ("factor", "original_context", "low_freq_factor", "high_freq_factor"),
                "yarn": tuple(_ROPE_KEYS)}


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, float, RopeScaling | None]:
    """(base, rotated fraction, scaling) from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` / ``rope_scaling`` (earlier configs), read as transformers reads them:
    original_max_position_embeddings defaults to max_position_embeddings (dynamic scales
    beyond max_position_embeddings itself), YaRN's factor to their ratio."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise MoeifyError(f"config.json uses RoPE scaling {kind!r}; moeify implements "
                          f"rope_type {', '.join(ROPE_TYPES)}")
    base = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    fraction = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if kind == "default":
        return base, fraction, None
    positions = hf.get("max_position_embeddings")
    original = hf.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings") or positions
    if kind == "dynamic":
        original = positions
    factor = params.get("factor")
    if factor is None and kind == "yarn" and original and positions:
        factor = positions / original
    if factor is None or original is None:
        raise MoeifyError(f"config.json: RoPE scaling {kind!r} needs factor and "
                          "max_position_embeddings")
    given = {f: params[_ROPE_KEYS[f]] for f in _ROPE_FIELDS[kind]
             if params.get(_ROPE_KEYS[f]) is not None}
    given.update(factor=float(factor), original_context=int(original))
    if kind == "yarn":  # transformers: ``or 32`` / ``or 1`` (a 0 reads as the default)
        given["beta_fast"] = float(params.get("beta_fast") or 32)
        given["beta_slow"] = float(params.get("beta_slow") or 1)
    try:
        return base, fraction, RopeScaling(kind=kind, **given)
    except (TypeError, ValueError) as e:
        raise MoeifyError(f"config.json: RoPE scaling {kind!r} cannot be read ({e})") from None


def rope_to_hf(base: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """``rope_parameters`` of a native config (the inverse of ``rope_from_hf``)."""
    out: dict[str, Any] = {"rope_type": "default" if scaling is None else scaling.kind,
                           "rope_theta": base}
    if scaling is not None:
        for f in _ROPE_FIELDS[scaling.kind]:
            value = getattr(scaling, f)
            if value is not None and not (scaling.kind == "dynamic" and f == "original_context"):
                out[_ROPE_KEYS[f]] = value
    return out


# ---------------------------------------------------------------------- config.json

# The structural keys of each family's config.json, as rows (moeify field, Hugging Face key,
# default, transform). Import (``config_from_hf``) reads a family's rows into a flat dict of
# moeify fields, from which moeify.interop.hf_import builds the ModelConfig; the native export
# (``config_to_hf``) writes the same rows from the same fields, which moeify.interop.hf_native
# reads off the ModelConfig. The fields:
#
#   vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_head, norm_eps, context_length (and
#   GPT-2's max_positions), tie_embeddings, activation, qkv_bias / out_bias (attention), qk_norm,
#   d_ff and mlp_bias (the dense MLPs), rope_base / rope_fraction / rope_scaling (the RoPE pair
#   above); MoE: n_experts, k, expert_d_ff, renormalize, balance_coef, shared_d_ff (Qwen2-MoE's
#   shared expert; 0: none), sparse_step and mlp_only_layers (Qwen-MoE's dense layers);
#   sliding_window and use_sliding_window (import caps the context at the window; the moeify
#   model has none, so the export writes the source's).

class _Needed:
    def __repr__(self) -> str:
        return "NEEDED"


NEEDED = _Needed()  # a Key's default when config.json must hold the key


def _identity(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Key:
    """The config.json key ``theirs`` <-> the moeify field ``ours`` (a tuple: import sets each,
    the export writes the first, which hf_native's checks make equal to the others).

    Import reads ``read(value)``; a key absent or null reads as ``default`` (a Hugging Face value,
    or a function of the fields read before it; NEEDED: the import is refused). The export writes
    ``write(field)``; a field the model leaves None keeps the source config's value, else writes
    the default. ``kept``: the source's value wins (the moeify field is a capped view of it: the
    context at a sliding window). ``aliases``: other names transformers maps on the key, read when
    ``theirs`` is absent and dropped from the export."""

    ours: str | tuple[str, ...]
    theirs: str
    default: Any = NEEDED
    read: Callable[[Any], Any] = _identity
    write: Callable[[Any], Any] = _identity
    kept: bool = False
    aliases: tuple[str, ...] = ()

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.ours,) if isinstance(self.ours, str) else self.ours

    def default_of(self, fields: dict[str, Any]) -> Any:
        """The Hugging Face value an absent key stands for, given the other fields."""
        return self.default(fields) if callable(self.default) else self.default


@dataclass(frozen=True)
class Fixed:
    """A config.json key with the one value moeify implements, which the export writes. Import
    refuses another value in one line naming the ``variant`` (absent or null reads as ``value``);
    without a variant (dropout rates, which an imported model does not keep) it reads nothing."""

    theirs: str
    value: Any
    variant: str | None = None


def _activation_key(theirs: str, gpt2: bool, default: str) -> Key:
    def read(name: str) -> str:
        ours = activation_from_hf(name, gpt2)
        if ours is None:
            raise MoeifyError(f"config.json: {theirs} {name!r} is not supported; moeify has "
                              f"{', '.join(hf_activation_names(gpt2))}")
        return ours

    return Key("activation", theirs, default, read, lambda ours: activation_to_hf(ours, gpt2))


def _experts_key(theirs: str) -> Key:  # Qwen3-MoE's config maps one name on the other
    other = "num_experts" if theirs == "num_local_experts" else "num_local_experts"
    return Key("n_experts", theirs, read=int, aliases=(other,))


GPT2_KEYS = (
    Key("vocab_size", "vocab_size"), Key("d_model", "n_embd"), Key("n_layers", "n_layer"),
    Key("n_heads", "n_head"), Key(("max_positions", "context_length"), "n_positions"),
    Key("d_ff", "n_inner", lambda f: 4 * f["d_model"]),
    _activation_key("activation_function", True, "gelu_new"),
    Key("norm_eps", "layer_norm_epsilon", 1e-5, float),
    Key("tie_embeddings", "tie_word_embeddings", True, bool),
    Fixed("scale_attn_weights", True, "unscaled attention, a GPT-2 variant"),
    Fixed("scale_attn_by_inverse_layer_idx", False, "a GPT-2 variant"),
    Fixed("reorder_and_upcast_attn", False, "a GPT-2 variant"),
    Fixed("resid_pdrop", 0.0), Fixed("embd_pdrop", 0.0), Fixed("attn_pdrop", 0.0))
_LLAMA_BODY = (
    Key("vocab_size", "vocab_size"), Key("d_model", "hidden_size"),
    Key("n_layers", "num_hidden_layers"), Key("n_heads", "num_attention_heads"),
    Key("n_kv_heads", "num_key_value_heads", lambda f: f["n_heads"]),
    Key("d_head", "head_dim", lambda f: f["d_model"] // f["n_heads"]),
    Key("norm_eps", "rms_norm_eps", 1e-6, float),
    Key("context_length", "max_position_embeddings", read=int, kept=True),
    Key("tie_embeddings", "tie_word_embeddings", False, bool),
    _activation_key("hidden_act", False, "silu"), Fixed("attention_dropout", 0.0))
_ATTENTION_BIAS = Key(("qkv_bias", "out_bias"), "attention_bias", False, bool)
_DENSE = Key("d_ff", "intermediate_size", read=int)
_WINDOW = Key("sliding_window", "sliding_window", None)
_QWEN_WINDOW = (_WINDOW, Key("use_sliding_window", "use_sliding_window", False, bool))
_MOE = (Key("k", "num_experts_per_tok", read=int),
        Key("balance_coef", "router_aux_loss_coef", 0.0, float),
        Fixed("router_jitter_noise", 0.0, "multiplicative router noise in training"),
        Fixed("output_router_logits", False))
_RENORMALIZE = Key("renormalize", "norm_topk_prob", False, bool)
_EXPERT_D_FF = Key("expert_d_ff", "intermediate_size", read=int)  # Mixtral, OLMoE
_QWEN_MOE = (Key("expert_d_ff", "moe_intermediate_size", read=int),
             _experts_key("num_experts"), _RENORMALIZE,
             Key("d_ff", "intermediate_size", lambda f: f["expert_d_ff"], int),
             Key("sparse_step", "decoder_sparse_step", 1, lambda s: int(s) or 1),
             Key("mlp_only_layers", "mlp_only_layers", (), list), *_QWEN_WINDOW)
# model_type -> its rows (the Llama family's also carry rope_parameters: rope_from_hf above).
CONFIG_KEYS = {
    "gpt2": GPT2_KEYS,
    "llama": (*_LLAMA_BODY, _ATTENTION_BIAS, _DENSE, Key("mlp_bias", "mlp_bias", False, bool)),
    "mistral": (*_LLAMA_BODY, _DENSE, _WINDOW),
    "qwen2": (*_LLAMA_BODY, _DENSE, *_QWEN_WINDOW),
    "mixtral": (*_LLAMA_BODY, *_MOE, _EXPERT_D_FF, _experts_key("num_local_experts"), _WINDOW),
    # Qwen2-MoE's own bias key: Qwen1.5-MoE configs, without it, have the biases.
    "qwen2_moe": (*_LLAMA_BODY, Key("qkv_bias", "qkv_bias", True, bool), *_MOE, *_QWEN_MOE,
                  Key("shared_d_ff", "shared_expert_intermediate_size", read=int)),
    "qwen3_moe": (*_LLAMA_BODY, _ATTENTION_BIAS, *_MOE, *_QWEN_MOE),
    "olmoe": (*_LLAMA_BODY, _ATTENTION_BIAS, *_MOE, _EXPERT_D_FF, _experts_key("num_experts"),
              _RENORMALIZE,
              Fixed("clip_qkv", None, "OLMoE's clamping of queries, keys and values")),
}
# The moeify fields a family's modelling code fixes, with no config.json key (the native
# export's checks, moeify.interop.hf_native, hold a model to them).
FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "mistral": {"qkv_bias": False, "out_bias": False},
    "qwen2": {"qkv_bias": True, "out_bias": False},
    "mixtral": {"qkv_bias": False, "out_bias": False, "renormalize": True},
    "qwen2_moe": {"out_bias": False}, "qwen3_moe": {"qk_norm": "head"},
    "olmoe": {"qk_norm": "full"},
}


def _fixed_from_hf(key: Fixed, value: Any) -> None:
    if key.variant is not None and value is not None and value != key.value:
        raise MoeifyError(f"config.json sets {key.theirs}={json.dumps(value)} ({key.variant}), "
                          "which moeify does not implement")


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The moeify fields of a supported config.json (its family's rows, above), or a one-line
    MoeifyError for a needed key it lacks or a variant moeify does not implement."""
    kind = hf["model_type"]
    fields = dict(FAMILY_FIELDS.get(kind, {}))
    for key in CONFIG_KEYS[kind]:
        if isinstance(key, Fixed):
            _fixed_from_hf(key, hf.get(key.theirs))
            continue
        value = next((hf[k] for k in (key.theirs, *key.aliases) if hf.get(k) is not None), None)
        if value is None:
            if key.default is NEEDED:
                raise MoeifyError(f"config.json has no {key.theirs!r}; it is needed to rebuild "
                                  "the model")
            value = key.default_of(fields)
        fields.update(dict.fromkeys(key.fields, None if value is None else key.read(value)))
    if kind != "gpt2":
        fields["rope_base"], fields["rope_fraction"], fields["rope_scaling"] = rope_from_hf(hf)
    return fields


def config_to_hf(kind: str, fields: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """config.json's entries for the moeify ``fields`` as ``kind`` (the inverse of
    ``config_from_hf``) over ``base``, the source config's entries the export keeps."""
    out = dict(base)
    for key in CONFIG_KEYS[kind]:
        if isinstance(key, Fixed):
            out[key.theirs] = key.value
            continue
        for alias in key.aliases:
            out.pop(alias, None)
        value = fields.get(key.fields[0])
        if key.kept and key.theirs in out:
            continue
        if value is not None:
            out[key.theirs] = key.write(value)
        elif key.theirs not in out:
            assert key.default is not NEEDED, key
            out[key.theirs] = key.default_of(fields)
    if kind != "gpt2":
        out["rope_parameters"] = rope_to_hf(fields["rope_base"], fields["rope_scaling"])
    return out


# ---------------------------------------------------------------------- tensors

@dataclass(frozen=True)
class Link:
    """moeify tensors ``ours`` <-> Hugging Face tensors ``theirs``, by ``form`` (module
    docstring)."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    form: str = "same"


# form -> (moeify tensors -> Hugging Face tensors, and back given the number n of moeify
# tensors): each form's two directions side by side, inverse by construction.
_TRANSFORMS: dict[str, tuple[Callable, Callable]] = {
    "same": (lambda xs: list(xs), lambda ys, n: list(ys)),
    "t": (lambda xs: [xs[0].t()], lambda ys, n: [ys[0].t()]),
    "cat_t": (lambda xs: [torch.cat([x.t() for x in xs], 1)],
              lambda ys, n: [c.t() for c in ys[0].chunk(n, 1)]),
    "cat": (lambda xs: [torch.cat(xs)], lambda ys, n: list(ys[0].chunk(n))),
    "stack_t": (lambda xs: [x.t() for x in xs[0]],
                lambda ys, n: [torch.stack([y.t() for y in ys])]),
}
FORMS = tuple(_TRANSFORMS)


def to_hf(link: Link, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The Hugging Face tensors of ``link`` from its moeify tensors."""
    return _TRANSFORMS[link.form][0](tensors)


def from_hf(link: Link, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The moeify tensors of ``link`` from its Hugging Face tensors (inverse of ``to_hf``)."""
    return _TRANSFORMS[link.form][1](tensors, len(link.ours))


def _same(ours: str, theirs: str) -> Link:
    return Link((ours,), (theirs,))


def _gpt2_links(cfg) -> list[Link]:
    out = [_same("embedding.weight", "transformer.wte.weight"),
           _same("pos_embedding.weight", "transformer.wpe.weight"),
           _same("ln_f.weight", "transformer.ln_f.weight"),
           _same("ln_f.bias", "transformer.ln_f.bias")]
    for i in range(cfg.n_layers):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        qkv = [b + f"attention.w_{n}." for n in "qkv"]
        out += [Link(tuple(x + "weight" for x in qkv), (h + "attn.c_attn.weight",), "cat_t"),
                Link(tuple(x + "bias" for x in qkv), (h + "attn.c_attn.bias",), "cat")]
        for ours, theirs in (("attention.w_o", "attn.c_proj"), ("feedforward.w1", "mlp.c_fc"),
                             ("feedforward.w2", "mlp.c_proj")):
            out += [Link((b + ours + ".weight",), (h + theirs + ".weight",), "t"),
                    _same(b + ours + ".bias", h + theirs + ".bias")]
        for ln, hf_ln in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out += [_same(f"{b}{ln}.{p}", f"{h}{hf_ln}.{p}") for p in ("weight", "bias")]
    return out


# Where each family keeps its MoE block and its experts' (gate, up, down) names, as
# save_pretrained writes them.
MOE_BLOCKS = {"mixtral": ("block_sparse_moe.", ("w1", "w3", "w2"))}
MOE_BLOCK_DEFAULT = ("mlp.", ("gate_proj", "up_proj", "down_proj"))


def moe_block(kind: str) -> tuple[str, tuple[str, str, str]]:
    return MOE_BLOCKS.get(kind, MOE_BLOCK_DEFAULT)


def _swiglu_links(ours: str, theirs: str, bias: bool) -> list[Link]:
    parts = ("weight", "bias") if bias else ("weight",)
    return [_same(f"{ours}{o}.{p}", f"{theirs}{t}.{p}") for o, t in
            (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
            for p in parts]


def _llama_links(kind: str, cfg) -> list[Link]:
    from moeify.layers.switch_ff import SwitchFFConfig

    out = [_same("embedding.weight", "model.embed_tokens.weight"),
           _same("ln_f.weight", "model.norm.weight")]
    a = cfg.attention_layers()[0]
    for i, f in enumerate(cfg.feedforward_layers()):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        for ours, theirs, bias in (("w_q", "q_proj", a.qkv_bias), ("w_k", "k_proj", a.qkv_bias),
                                   ("w_v", "v_proj", a.qkv_bias), ("w_o", "o_proj", a.out_bias)):
            out += [_same(f"{b}attention.{ours}.{p}", f"{h}self_attn.{theirs}.{p}")
                    for p in (("weight", "bias") if bias else ("weight",))]
        if a.qk_norm != "none":
            out += [_same(f"{b}attention.{n}.weight", f"{h}self_attn.{n}.weight")
                    for n in ("q_norm", "k_norm")]
        out += [_same(b + "ln1.weight", h + "input_layernorm.weight"),
                _same(b + "ln2.weight", h + "post_attention_layernorm.weight")]
        ff = b + "feedforward."
        if not isinstance(f, SwitchFFConfig):
            out += _swiglu_links(ff, h + "mlp.", f.bias)
            continue
        block, (g, u, d) = moe_block(kind)
        experts = [f"{h}{block}experts.{e}." for e in range(f.n_experts)]
        out.append(_same(ff + "w_router", h + block + "gate.weight"))
        out += [Link((ff + "experts." + ours,), tuple(x + f"{theirs}.weight" for x in experts),
                     "stack_t")
                for ours, theirs in (("w_gate", g), ("w_in", u), ("w_out", d))]
        if f.shared is not None:
            out += _swiglu_links(ff + "shared.", h + block + "shared_expert.", False)
            out.append(_same(ff + "shared_gate.weight", h + block + "shared_expert_gate.weight"))
    return out


def tensor_links(kind: str, cfg) -> list[Link]:
    """Every tensor of the moeify model ``cfg`` as the Hugging Face ``kind`` names it."""
    out = _gpt2_links(cfg) if kind == "gpt2" else _llama_links(kind, cfg)
    if not cfg.tie_embeddings:
        out.append(_same("output.weight", "lm_head.weight"))
    return out


__all__ = ["ARCHITECTURES", "DENSE_TYPES", "MOE_TYPES", "CONFIG_KEYS", "Key", "Fixed",
           "config_from_hf", "config_to_hf", "Link", "tensor_links", "to_hf", "from_hf",
           "rope_from_hf", "rope_to_hf", "activation_from_hf", "activation_to_hf"]
