"""Model overrides: "model.<field>=value" and "model.<attention|feedforward|depth>.<field>=value"
applied to a preset's ModelConfig (moeify.train.config documents the keys, and resolves a
TrainConfig's model with these functions)."""

from __future__ import annotations

import dataclasses
from typing import Any

from moeify.errors import MoeifyError
from moeify.models.config import ModelConfig, field_hints
from moeify.models.presets import get_preset
from moeify.rundir.files import read_model_config
from moeify.train.values import parse_value, split_override

_PATTERNS = ("attention", "feedforward", "depth")
_SINGLE = ("norm", "recursion")  # one config each (not one per layer)
_PROPAGATED = ("d_model", "n_layers")


# The preset of a run whose model is no preset (one imported from a Hugging Face checkpoint): its
# model is the run directory's model.json, so it can only be resumed, not started afresh.
RUN_MODEL_PRESET = "run-model"


BYTE_VOCAB = 256


def byte_level_preset(preset: str) -> bool:
    """Whether the preset is built for bytes (a vocabulary of at most 256 symbols), so that
    tokenizer "auto" reads any corpus as bytes for it."""
    return preset != RUN_MODEL_PRESET and get_preset(preset).vocab_size <= BYTE_VOCAB


def base_model_config(preset: str, run_dir=None) -> ModelConfig:
    if preset == RUN_MODEL_PRESET:
        if run_dir is None:
            raise ValueError(f"preset {RUN_MODEL_PRESET!r} means the model.json of an existing run "
                             "(e.g. one made by `moeify import`): continue it with --resume RUN")
        try:
            return read_model_config(run_dir)
        except MoeifyError as e:
            raise ValueError(str(e)) from None
    return get_preset(preset)


def _hint_from_value(value: Any) -> Any:
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        return int
    if isinstance(value, float):
        return float
    if isinstance(value, frozenset):
        return frozenset[str]
    if isinstance(value, tuple):
        return tuple[str, ...]
    return str


def _parse_layer_field(cfg: Any, name: str, text: str, what: str) -> Any:
    names = [f.name for f in dataclasses.fields(cfg)]
    if name not in names:
        raise ValueError(f"{what}: {type(cfg).__name__} has no field {name!r}; its fields are "
                         f"{', '.join(names)}")
    hint = field_hints(type(cfg)).get(name) or _hint_from_value(getattr(cfg, name))
    return parse_value(text, hint, what=what)


def apply_model_overrides(config: ModelConfig, overrides: list[str] | tuple[str, ...],
                          ) -> ModelConfig:
    """``config`` with "model.<...>=value" overrides applied (a later value of the same key
    wins). Each value is parsed and checked against its field at once; the configs are then
    rebuilt once with every change, so fields that must agree (model.norm.kind=rmsnorm and
    model.norm.bias=false) may be set in any order."""
    top: dict[str, Any] = {}                         # ModelConfig field -> value
    single: dict[str, dict[str, Any]] = {n: {} for n in _SINGLE}  # norm / recursion fields
    layer: dict[str, dict[str, str]] = {p: {} for p in _PATTERNS}  # pattern -> field -> text
    items: list[str] = []
    for item in overrides:
        key, text = split_override(item)
        what = f"--set {item}"
        parts = key.split(".")
        if parts[0] != "model" or len(parts) not in (2, 3):
            raise ValueError(f"{what}: model settings are model.<field> or "
                             f"model.<attention|feedforward|depth|norm>.<field>")
        items.append(item)
        if len(parts) == 3 and parts[1] in _SINGLE:
            single[parts[1]][parts[2]] = _parse_single(config, parts[1], parts[2], text, what)
        elif len(parts) == 3:
            _check_pattern_field(config, parts[1], parts[2], text, what)
            layer[parts[1]][parts[2]] = text
        else:
            top[parts[1]] = _parse_top(config, parts[1], text, what)
    if not items:
        return config
    what = "--set " + " --set ".join(items)
    try:
        return _rebuild(config, top, single, layer)
    except ValueError as e:
        raise ValueError(e if str(e).startswith("--set ") else f"{what}: {e}") from None


def _parse_single(config: ModelConfig, sub_name: str, name: str, text: str, what: str) -> Any:
    """A field of a config the model has once, not per layer: model.norm.<kind|eps|bias>,
    model.recursion.<field>."""
    sub = getattr(config, sub_name)
    if sub is None:
        raise ValueError(f"{what}: this model has no recursion (Mixture-of-Recursions) "
                         "config to change; use a MoR preset (e.g. repro-mor)")
    return _parse_layer_field(sub, name, text, what)


def _check_pattern_field(config: ModelConfig, pattern: str, name: str, text: str,
                         what: str) -> None:
    """model.<attention|feedforward|depth>.<field>: every entry of the pattern must have the
    field and accept the value."""
    if pattern not in _PATTERNS:
        raise ValueError(f"{what}: {pattern!r} is not one of {', '.join(_PATTERNS)}")
    entries = getattr(config, pattern)
    if all(e is None for e in entries):
        raise ValueError(f"{what}: this model has no {pattern} config to change")
    for e in entries:
        if e is not None:
            _parse_layer_field(e, name, text, what)


def _parse_top(config: ModelConfig, name: str, text: str, what: str) -> Any:
    """model.<field>: a ModelConfig field that is not a layer pattern or a single config."""
    fields = ({f.name for f in dataclasses.fields(ModelConfig)} - set(_PATTERNS)
              - {"norm", "recursion"})
    if name == "recursion":
        raise ValueError(f"{what}: model.recursion is a MoRConfig: start from a MoR preset "
                         "(e.g. repro-mor) and set its fields, model.recursion.<field>")
    if name == "norm":
        raise ValueError(f"{what}: model.norm is a NormConfig: set its fields, "
                         "model.norm.kind, model.norm.eps or model.norm.bias (RMSNorm: "
                         "--set model.norm.bias=false --set model.norm.kind=rmsnorm)")
    if name not in fields:
        raise ValueError(f"{what}: ModelConfig has no settable field {name!r}; choose one of "
                         f"{', '.join(sorted(fields))} or model.<attention|feedforward|depth>"
                         ".<field>")
    hint = field_hints(ModelConfig).get(name) or _hint_from_value(getattr(config, name))
    return parse_value(text, hint, what=what)


def _rebuild(config: ModelConfig, top: dict[str, Any], single: dict[str, dict[str, Any]],
             layer: dict[str, dict[str, str]]) -> ModelConfig:
    """``config`` rebuilt once with every parsed change."""
    changes: dict[str, Any] = dict(top)
    for pattern in _PATTERNS:
        entries = getattr(config, pattern)
        new = tuple(e if e is None else _layer_with(e, top, layer[pattern]) for e in entries)
        if new != entries:
            changes[pattern] = new
    if "d_model" in top and config.recursion is not None:
        single["recursion"] = {"d_model": top["d_model"], **single["recursion"]}
    for name, fields in single.items():
        if fields:
            changes[name] = dataclasses.replace(getattr(config, name), **fields)
    return dataclasses.replace(config, **changes)


def _layer_with(entry: Any, top: dict[str, Any], texts: dict[str, str]) -> Any:
    """A layer config with the propagated model fields (d_model, n_layers) and its own
    overrides (which win) applied in one replace."""
    names = {f.name for f in dataclasses.fields(entry)}
    changes = {n: top[n] for n in _PROPAGATED if n in top and n in names}
    changes.update({n: _parse_layer_field(entry, n, t, f"--set model.*.{n}={t}")
                    for n, t in texts.items()})
    return dataclasses.replace(entry, **changes) if changes else entry
