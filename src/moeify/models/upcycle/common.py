"""What every conversion of moeify.models.upcycle shares: option parsing, seeded draws, shapes.

A conversion spec is ``kind:key=value,key=value``; a bare item after ``key=value`` extends that
key's list (``mod:blocks=1,3,capacity=0.5`` is blocks [1, 3] and capacity 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Spec:
    """One conversion: its kind (``switchhead``, ``moa``, ``sigma-moe``, ``switch``, ``mod``) and
    options as parsed values (int, float, bool, str, or a list of them)."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_spec(text: str | Spec, what: str) -> Spec:
    """``"sigma-moe:E=8,k=2"`` -> Spec("sigma-moe", {"E": 8, "k": 2}). ``what`` names the flag in
    error messages (--attention, --ff, --depth)."""
    if isinstance(text, Spec):
        return text
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what} needs a conversion such as 'switchhead:E=4,k=2', got {text!r}")
    kind, _, rest = text.strip().partition(":")
    options: dict[str, Any] = {}
    last = None
    for item in filter(None, (s.strip() for s in rest.split(","))):
        if "=" in item:
            key, _, val = item.partition("=")
            key = key.strip()
            if not key or key in options:
                raise ValueError(f"{what} {text!r}: option {key!r} is empty or given twice")
            options[key], last = _value(val.strip()), key
        elif last is not None:
            prev = options[last]
            options[last] = (prev if isinstance(prev, list) else [prev]) + [_value(item)]
        else:
            raise ValueError(f"{what} {text!r}: {item!r} is not key=value")
    return Spec(kind.strip().lower(), options)


def take_options(spec: Spec, what: str, defaults: dict[str, Any],
                 required: tuple[str, ...] = ()) -> dict[str, Any]:
    """``defaults`` updated with the spec's options; unknown or missing options are one-line
    errors naming the known ones."""
    unknown = sorted(set(spec.options) - set(defaults) - set(required))
    if unknown:
        raise ValueError(f"{what} {spec.kind}: unknown option(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(set(defaults) | set(required)))}")
    missing = [r for r in required if r not in spec.options]
    if missing:
        raise ValueError(f"{what} {spec.kind}: give {', '.join(missing)} (e.g. "
                         f"{spec.kind}:{','.join(f'{m}=4' for m in missing)})")
    out = {**defaults, **spec.options}
    for key, default in defaults.items():
        if isinstance(default, bool) and not isinstance(out[key], bool):
            raise ValueError(f"{what} {spec.kind}: {key} must be true or false, got {out[key]!r}")
        if isinstance(default, float) and isinstance(out[key], int) and not isinstance(
                out[key], bool):
            out[key] = float(out[key])
    return out


def positive_int(value: Any, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}: {name} must be a positive integer, got {value!r}")
    return value


def generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


def normal_like(w: torch.Tensor, std: float, gen: torch.Generator, mean: float = 0.0
                ) -> torch.Tensor:
    """A seeded N(mean, std²) draw of ``w``'s shape, on the CPU in float32, then cast to ``w``."""
    return (torch.randn(w.shape, generator=gen) * std + mean).to(w.dtype)


def small_router(shape: tuple[int, ...], std: float, scale: float, gen: torch.Generator
                 ) -> torch.Tensor:
    """A router weight ``scale`` times a fresh N(0, std²) draw: scale 0 gives the all-zero router
    (every score 0, so every sigmoid gate is 1/2 and every softmax probability 1/E exactly);
    a small scale keeps the scores near 0 while breaking the ties of the top-k at random."""
    if scale < 0:
        raise ValueError(f"router_scale must be >= 0, got {scale}")
    return torch.randn(shape, generator=gen) * (std * scale)


def head_view(w: torch.Tensor, n_heads: int, d_head: int, *, rows: bool) -> torch.Tensor:
    """A dense attention projection per head: [D, H·C] -> [H, D, C] (``rows=False``: Q, K, V,
    position) or [H·C, D] -> [H, C, D] (``rows=True``: O)."""
    if rows:
        return w.reshape(n_heads, d_head, w.shape[-1])
    return w.reshape(w.shape[0], n_heads, d_head).permute(1, 0, 2)
