"""``--set key=value`` text: splitting an override and parsing a value to a field's type."""

from __future__ import annotations

import types
import typing
from typing import Any

def split_override(item: str) -> tuple[str, str]:
    if not isinstance(item, str) or "=" not in item:
        raise ValueError(f"--set expects key=value (e.g. --set lr=1e-3), got {item!r}")
    key, value = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ValueError(f"--set {item!r}: the key before '=' is empty")
    return key, value.strip()


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_value(text: str, hint: Any, *, what: str) -> Any:
    """``text`` converted to the type ``hint`` (int, float, bool, str, Optional, tuple, set,
    Literal), or a ValueError that names the expected type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        if type(None) in args and text.lower() in ("none", "null"):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return parse_value(text, a, what=what)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{what}: cannot parse {text!r}")
    if origin is typing.Literal:
        for a in args:
            if str(a) == text:
                return a
        raise ValueError(f"{what}: expected one of {', '.join(map(str, args))}, got {text!r}")
    if origin in (tuple, set, frozenset, list):
        parts = [p.strip() for p in text.split(",") if p.strip()] if text else []
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(parts) != len(args):
                raise ValueError(f"{what}: expected {len(args)} comma-separated values, got "
                                 f"{text!r}")
            return tuple(parse_value(p, a, what=what) for p, a in zip(parts, args))
        elem = args[0] if args else str
        vals = [parse_value(p, elem, what=what) for p in parts]
        return origin(vals) if origin is not tuple else tuple(vals)
    if hint is bool:
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"{what}: expected true or false, got {text!r}")
    if hint is int:
        try:
            return int(text)
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
            raise ValueError(f"{what}: expected an integer, got {text!r}") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{what}: expected a number, got {text!r}") from None
    if hint is str or hint is Any or hint is None:
        return text
    raise ValueError(f"{what}: settings of type {hint} cannot be set from the command line")
