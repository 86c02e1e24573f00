"""What a preset is: a named ModelConfig builder with the facts of the paper row it reproduces
(its dataset, the dense baseline it is compared with, its training recipe). The presets
themselves are the literal table of moeify.models.presets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moeify.models.config import ModelConfig


@dataclass(frozen=True)
class PaperRecipe:
    """The parts of the published training recipe that differ between rows (SwitchHead appendix):
    batch size, linear warm-up steps and the gradient-clipping threshold."""

    batch_size: int
    warmup_steps: int
    grad_clip: float


# §3: batch 64, no warm-up, clipping 0.1 for the small models; the big ones (and every SwitchAll
# model) clip at 0.25, the big ones warm up for 4000 steps; enwik8 uses batch 32, clipping 0.25.
SMALL = PaperRecipe(batch_size=64, warmup_steps=0, grad_clip=0.1)
SMALL_SWITCHALL = PaperRecipe(batch_size=64, warmup_steps=0, grad_clip=0.25)
BIG = PaperRecipe(batch_size=64, warmup_steps=4000, grad_clip=0.25)
ENWIK8_RECIPE = PaperRecipe(batch_size=32, warmup_steps=0, grad_clip=0.25)


@dataclass(frozen=True)
class Preset:
    """name, description, ``fn() -> ModelConfig``; for a paper row also ``data`` (the corpus it
    trains on), ``baseline`` (the dense preset it is compared with; None for a baseline) and
    ``recipe``. Tiny and CPU-scale presets carry a baseline where one of the same shape exists."""

    name: str
    description: str
    fn: Callable[[], ModelConfig]
    data: str | None = None
    baseline: str | None = None
    recipe: PaperRecipe | None = None

    def build_config(self) -> ModelConfig:
        return self.fn()


def paper(name: str, description: str, fn: Callable[[], ModelConfig], *, data: str,
          recipe: PaperRecipe, baseline: str | None = None) -> Preset:
    """One row of the paper table (the keywords a paper row must carry)."""
    return Preset(name, description, fn, data=data, baseline=baseline, recipe=recipe)
