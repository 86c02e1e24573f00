"""The one mapping between moeify models and Hugging Face checkpoints, per family: which
architecture class each ``model_type`` is, the activation and RoPE names, and every tensor as a
``Link`` (moeify names, Hugging Face names, transform). Import (moeify.interop.hf_import) reads
each link one way and the native export (moeify.interop.hf_native) the other, so an import
followed by an export gives back the checkpoint's tensors: each transform's two directions
are inverse by construction (``to_hf`` / ``from_hf`` below).

    same     one tensor, same layout
    t        one tensor transposed (GPT-2's Conv1D keeps [in, out]; torch's Linear [out, in])
    cat_t    several moeify matrices, transposed and side by side in one Hugging Face tensor
             (GPT-2's c_attn = [W_q^T | W_k^T | W_v^T]); equal widths
    cat      several moeify vectors end to end in one (GPT-2's c_attn bias)
    stack_t  one moeify [E, a, b] expert tensor <-> E Hugging Face matrices [b, a] (the
             per-expert layout save_pretrained writes; moeify stacks them as [E, D, F])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


# ---------------------------------------------------------------------- tensors

FORMS = ("same", "t", "cat_t", "cat", "stack_t")


@dataclass(frozen=True)
class Link:
    """moeify tensors ``ours`` <-> Hugging Face tensors ``theirs``, by ``form`` (module
    docstring)."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    form: str = "same"


def to_hf(link: Link, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The Hugging Face tensors of ``link`` from its moeify tensors."""
    if link.form == "same":
        return list(tensors)
    if link.form == "t":
        return [tensors[0].t()]
    if link.form == "cat_t":
        return [torch.cat([x.t() for x in tensors], 1)]
    if link.form == "cat":
        return [torch.cat(tensors)]
    if link.form == "stack_t":
        return [x.t() for x in tensors[0]]
    raise AssertionError(link.form)


def from_hf(link: Link, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The moeify tensors of ``link`` from its Hugging Face tensors (inverse of ``to_hf``)."""
    if link.form == "same":
        return list(tensors)
    if link.form == "t":
        return [tensors[0].t()]
    if link.form == "cat_t":
        return [c.t() for c in tensors[0].chunk(len(link.ours), 1)]
    if link.form == "cat":
        return list(tensors[0].chunk(len(link.ours)))
    if link.form == "stack_t":
        return [torch.stack([x.t() for x in tensors])]
    raise AssertionError(link.form)


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


__all__ = ["ARCHITECTURES", "DENSE_TYPES", "MOE_TYPES", "Link", "tensor_links", "to_hf",
           "from_hf", "rope_from_hf", "rope_to_hf", "activation_from_hf", "activation_to_hf"]
