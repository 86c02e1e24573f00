"""What ``moeify train --list-settings`` prints: every ``--set`` key, training settings and the
model fields of a preset, with its default, the values it accepts and what it does."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from moeify.models.config import ModelConfig
from moeify.train.config import (AMP_MODES, PARALLEL_MODES, TOKENIZER_CHOICES, WRITTEN_BY_MOEIFY,
                                 TrainConfig)
from moeify.train.overrides import base_model_config

_PATTERNS = ("attention", "feedforward", "depth")

TRAIN_HELP = {
    "preset": "the model (`moeify presets`); also --preset",
    "data": "corpus name or a local text file / directory; also --data",
    "tokenizer": "auto = bytes for byte-level corpora and presets, else SentencePiece BPE",
    "vocab_size": "SentencePiece vocabulary size",
    "steps": "optimizer updates; also --steps",
    "batch_size": "sequences per update, over all processes and accumulation steps",
    "grad_accum": "micro-batches per update",
    "lr": "peak learning rate (AdamW)",
    "betas": "AdamW betas, two numbers: betas=0.9,0.999",
    "weight_decay": "AdamW weight decay, on matrices only",
    "warmup_steps": "linear warm-up steps",
    "cosine_steps": "the cosine decay's length after the warm-up (none: the remaining steps)",
    "min_lr_ratio": "the decay's floor, as a fraction of lr",
    "grad_clip": "gradient-norm clipping threshold (0 = off)",
    "amp": "autocast: auto = bf16 (or fp16) on CUDA, fp32 elsewhere",
    "device": "auto (CUDA when available, else CPU), cpu, cuda, cuda:N, mps",
    "seed": "initialisation and training randomness",
    "log_every": "steps between metric records (metrics.jsonl)",
    "eval_every": "steps between validations (0 = only at the end)",
    "eval_tokens": "validation tokens scored (0 = the whole split)",
    "eval_batch_size": "validation streams scored side by side",
    "checkpoint_every": "steps between checkpoints (0 = only at the end)",
    "keep_checkpoints": "complete checkpoints kept on disk",
    "tensorboard": "also write TensorBoard scalars to RUN/tensorboard (pip install -e "
                   "'.[tensorboard]')",
    "compile": "torch.compile every block",
    "parallel": "under torchrun: ddp replicates the model, fsdp shards it (FSDP2)",
    "expert_parallel": "under torchrun (parallel=ddp or fsdp): split the sigma-MoE / Switch "
                       "experts over this many processes (a divisor of the process count and "
                       "of n_experts; 1 = off); checkpoints are sharded (DCP)",
    "activation_checkpointing": "none, or block: every block's activations are recomputed in "
                                "backward instead of kept (less memory, one more forward)",
}

# Fields several layer configs share, where their docstrings say nothing.
LAYER_HELP = {
    "d_model": "residual width (follows model.d_model)",
    "n_layers": "model depth, for the initialisation (follows model.n_layers)",
    "n_heads": "attention heads", "d_head": "width of each head",
    "n_experts": "experts (per head for SwitchHead)", "k": "experts chosen per token",
    "pos": "positions: xl (Transformer-XL relative), rope or none",
    "rope_fraction": "fraction of each head's channels rotated by RoPE",
    "rope_base": "RoPE base", "attn_impl": "attention core: auto or reference",
    "expert_impl": "expert-matmul implementation (auto picks per call)",
    "d_ff": "hidden units of the MLP",
}

_CHOICES = {"amp": AMP_MODES, "parallel": PARALLEL_MODES, "tokenizer": TOKENIZER_CHOICES}


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "|".join(str(a) for a in args)
    if args and type(None) in args:
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or none"
    if origin in (tuple, frozenset, set):
        return f"{origin.__name__} of {_type_name(args[0]) if args else 'values'} (a,b,...)"
    return getattr(hint, "__name__", str(hint))


def _doc_fields(cls) -> dict[str, str]:
    """``name: text`` entries of a config class's docstring (continuation lines joined)."""
    out: dict[str, str] = {}
    current = None
    for line in (cls.__doc__ or "").splitlines():
        m = re.match(r"^\s{4}([a-z_][a-z0-9_, ]*):\s+(.*)$", line)
        if m and all(n.strip().isidentifier() for n in m.group(1).split(",")):
            names = [n.strip() for n in m.group(1).split(",")]
            for n in names:
                out[n] = m.group(2).strip()
            current = names
        elif current and line.startswith(" " * 6) and line.strip():
            for n in current:
                out[n] += " " + line.strip()
        else:
            current = None
    return {k: _first_clause(v) if len(v) > 110 else v for k, v in out.items()}


def _first_clause(text: str) -> str:
    """A long meaning cut at its first "; ", closing any parenthesis the cut left open."""
    head = text.split("; ")[0]
    return head + ")" * max(0, head.count("(") - head.count(")"))


def _value(v: Any) -> str:
    if isinstance(v, frozenset):
        return ",".join(sorted(v))
    if isinstance(v, tuple):
        return ",".join(str(x) for x in v)
    return repr(v) if isinstance(v, str) else str(v)


def settings_rows(preset: str = "tiny-switchhead") -> list[tuple[str, str, str, str]]:
    """(key, default, accepted values, description) for every ``--set`` key: the training
    settings, then ``model.*`` for the preset's ModelConfig and its layer configs."""
    rows = []
    hints = typing.get_type_hints(TrainConfig)
    default = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("model", "model_overrides") or f.name in WRITTEN_BY_MOEIFY:
            continue
        kind = "|".join(_CHOICES[f.name]) if f.name in _CHOICES else _type_name(hints[f.name])
        rows.append((f.name, _value(getattr(default, f.name)), kind, TRAIN_HELP.get(f.name, "")))
    model = base_model_config(preset)
    mhints = typing.get_type_hints(ModelConfig)
    mdoc = _doc_fields(ModelConfig)
    for f in dataclasses.fields(ModelConfig):
        if f.name in _PATTERNS or f.name in ("norm", "recursion"):
            continue
        rows.append((f"model.{f.name}", _value(getattr(model, f.name)),
                     _type_name(mhints[f.name]), mdoc.get(f.name, "")))
    norm_doc = {"kind": "layernorm or rmsnorm (RMSNorm needs model.norm.bias=false first)",
                "eps": "added to the variance (mean square)",
                "bias": "LayerNorm's additive bias (RMSNorm has none)"}
    nhints = typing.get_type_hints(type(model.norm))
    for f in dataclasses.fields(model.norm):
        rows.append((f"model.norm.{f.name}", _value(getattr(model.norm, f.name)),
                     _type_name(nhints[f.name]), norm_doc.get(f.name, "")))
    if model.recursion is not None:  # Mixture-of-Recursions: model.recursion.<field>
        rdoc = _doc_fields(type(model.recursion))
        rhints = typing.get_type_hints(type(model.recursion))
        for f in dataclasses.fields(model.recursion):
            rows.append((f"model.recursion.{f.name}", _value(getattr(model.recursion, f.name)),
                         _type_name(rhints[f.name]), rdoc.get(f.name, "")))
    for pattern in _PATTERNS:
        entries = [e for e in getattr(model, pattern) if e is not None]
        if not entries:
            continue
        first = entries[0]
        doc = _doc_fields(type(first))
        lhints = typing.get_type_hints(type(first))
        for f in dataclasses.fields(first):
            values = {_value(getattr(e, f.name, None)) for e in entries}
            shown = values.pop() if len(values) == 1 else "varies by layer"
            text = doc.get(f.name) or LAYER_HELP.get(f.name, "")
            if f is dataclasses.fields(first)[0]:
                text = f"({type(first).__name__}) {text}"
            rows.append((f"model.{pattern}.{f.name}", shown, _type_name(lhints[f.name]), text))
    return rows
