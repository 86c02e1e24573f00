"""Learning-rate schedule: linear warm-up, then cosine decay (SwitchHead appendix), and what a
resumed run with a new length does to it.

The paper: "cosine schedule with T_max = 100k steps, offset by a linear warm-up of 4000 steps"
(262M-class models; no warm-up for the small ones). The factor multiplies the base lr; update
number s (0-based) uses factor(s):

    s < W:   (s + 1) / W                                     linear warm-up, never exactly 0
    s >= W:  r + (1 - r) * (1 + cos(pi * min(s - W, T) / T)) / 2

with W the warm-up steps, T the cosine's T_max and r the floor ratio (0 in the paper, as
torch's CosineAnnealingLR with eta_min = 0).

A run resumed with another ``steps`` changes only the rates of the updates still to come
(``resume_schedule``). ``TrainConfig.lr_extensions`` records each change made after the decay
began as (start, end, factor f0, phase p0): from update ``start`` on, the rest of a cosine
whose phase runs from p0 to pi at update ``end``, scaled to be f0 at ``start``:

    factor(s) = r + (f0 - r) * (1 + cos p) / (1 + cos p0),   p = p0 + (pi - p0) * (s - start) / (end - start)

``--schedule extend`` starts at phase 0 from the current rate; ``--schedule stretch`` takes the
phase and rate the warm-up + cosine recomputed over the new length has there. So the schedule
stays a function of the run's configuration, with the rates already used unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when a scheduler is made (the CLI's parser needs none)
    import torch

SCHEDULE_CHOICES = ("keep", "extend", "stretch")


def lr_factor(step: int, *, warmup_steps: int, cosine_steps: int,
              min_lr_ratio: float = 0.0) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t = min(step - warmup_steps, cosine_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t / cosine_steps))


def cosine_steps_of(cfg) -> int:
    """The cosine's T_max for a TrainConfig: ``cosine_steps`` or the steps after the warm-up."""
    if cfg.cosine_steps is not None:
        return cfg.cosine_steps
    return max(1, cfg.steps - cfg.warmup_steps)


def schedule_factor(cfg, step: int) -> float:
    """The factor of update ``step`` (0-based) under ``cfg``'s whole schedule: warm-up and
    cosine, then the latest extension that has begun."""
    for start, end, f0, p0 in reversed(cfg.lr_extensions):
        if step >= start:
            r = cfg.min_lr_ratio
            p = p0 + (math.pi - p0) * min(step - start, end - start) / (end - start)
            if 1.0 + math.cos(p0) <= 0.0:
                return r
            return r + (f0 - r) * (1.0 + math.cos(p)) / (1.0 + math.cos(p0))
    return lr_factor(step, warmup_steps=cfg.warmup_steps, cosine_steps=cosine_steps_of(cfg),
                     min_lr_ratio=cfg.min_lr_ratio)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule_factor(cfg, s))


def same_past(a, b, step: int) -> bool:
    """Whether schedules ``a`` and ``b`` give the same rate to the updates 0..step-1."""
    return all(schedule_factor(a, s) == schedule_factor(b, s) for s in range(step))


def _rate(cfg, step: int) -> float:
    return cfg.lr * schedule_factor(cfg, step)


def _trains(cfg, start: int) -> bool:
    """Whether any update start..steps-1 has a nonzero rate, computed from a few points (a run
    of 10^9 steps must not list its rates): the schedule is rising in the warm-up and
    non-increasing on each piece after it, so a piece's largest rate is its first (or, for the
    warm-up, positive throughout)."""
    if cfg.lr == 0 or start >= cfg.steps:
        return False
    starts = {start, cfg.warmup_steps, *(e[0] for e in cfg.lr_extensions)}
    return any(_rate(cfg, s) != 0 for s in starts if start <= s < cfg.steps)


def _lr(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def _describe(name: str, cfg, step: int) -> str:
    """What ``cfg`` does with updates step+1..steps (1-based, as the progress line counts)."""
    first, last = _rate(cfg, step), _rate(cfg, cfg.steps - 1)
    if name == "keep":
        what = "the run's own schedule"
    elif name == "extend":
        what = f"the decay continues from the current rate down to the floor at step {cfg.steps}"
    else:
        what = f"warm-up and cosine recomputed over {cfg.steps} steps"
    return f"{what}: lr {_lr(first)} at step {step + 1}, {_lr(last)} at step {cfg.steps}"


def resume_schedule(trained, requested, step: int, choice: str | None):
    """The configuration a run resumed at update ``step`` continues with, and a line saying what
    happened to its learning-rate schedule (None when nothing did).

    ``trained``: the settings the checkpoint was trained with; ``requested``: those of this
    invocation; ``choice``: ``--schedule`` (keep, extend, stretch or None). The rates of the
    updates already done never change. When ``steps`` changes after the decay has begun, the
    schedule over the remaining steps is ambiguous: a schedule whose length is pinned
    (``cosine_steps`` given, or an earlier extension) keeps it unless told otherwise; one that
    follows ``steps`` needs a choice, and the ValueError lists what each one would do."""
    if choice is not None and choice not in SCHEDULE_CHOICES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULE_CHOICES)}, got "
                         f"{choice!r}")
    trained = _with_written_schedule(trained, requested, step)
    if requested.steps == trained.steps or step == 0:  # the same schedule, or nothing trained
        return requested, (None if choice is None else
                           f"--schedule {choice} changes nothing: " + (
                               "the run has not trained a step yet, so its schedule simply "
                               f"covers the {requested.steps} steps" if step == 0 else
                               f"--steps is the run's own ({requested.steps})"))
    N = requested.steps
    options = _schedule_options(trained, requested, step)
    if choice is None:
        choice = _default_choice(trained, options, step, N)
    chosen = options[choice]
    if not _trains(chosen, step):
        raise ValueError(f"--schedule {choice} would train steps {step + 1}-{N} at learning rate "
                         f"0 ({_describe(choice, chosen, step)}), which changes nothing: choose "
                         "--schedule stretch, or start a new run from this one's weights with "
                         "--init-from")
    return chosen, (f"learning-rate schedule on resuming at step {step} with --steps {N}: "
                    f"{choice}, {_describe(choice, chosen, step)}")


def _with_written_schedule(trained, requested, step: int):
    """``trained`` with the schedule ``requested`` carries when it differs: one written into
    config.json (an earlier resume that stopped before its first checkpoint, or an edit),
    honoured when it keeps the rates already used."""
    pinned_fields = (trained.cosine_steps, tuple(trained.lr_extensions))
    if (requested.cosine_steps, tuple(requested.lr_extensions)) == pinned_fields:
        return trained
    if not same_past(trained, requested, step):
        raise ValueError(f"the learning-rate schedule requested (cosine_steps="
                         f"{requested.cosine_steps}, lr_extensions="
                         f"{list(requested.lr_extensions)}) changes the rates of the {step} "
                         "steps already trained; only the steps still to come can change")
    ext = tuple(requested.lr_extensions)
    return dataclasses.replace(trained, cosine_steps=requested.cosine_steps,
                               lr_extensions=ext, steps=ext[-1][1] if ext else trained.steps)


def _schedule_options(trained, requested, step: int) -> dict:
    """What keep, extend and stretch make of the updates step..requested.steps-1."""
    W, N = trained.warmup_steps, requested.steps
    keep = dataclasses.replace(requested, cosine_steps=cosine_steps_of(trained))
    if step <= W and not trained.lr_extensions:
        # The decay has not begun: a cosine over the new length keeps every rate used so far.
        stretch = extend = dataclasses.replace(requested, cosine_steps=(
            None if trained.cosine_steps is None else max(1, N - W)))
    else:
        def tail(f0: float, p0: float):
            return dataclasses.replace(keep, lr_extensions=tuple(trained.lr_extensions) + (
                (step, N, f0, p0),))

        extend = tail(schedule_factor(trained, step), 0.0)
        p0 = math.pi * (step - W) / max(1, N - W)
        r = trained.min_lr_ratio
        stretch = tail(r + (1.0 - r) * 0.5 * (1.0 + math.cos(p0)), p0)
    return {"keep": keep, "extend": extend, "stretch": stretch}


def _default_choice(trained, options: dict, step: int, N: int) -> str:
    """The choice a resume without ``--schedule`` takes: stretch before the decay has begun,
    keep for a pinned schedule that still trains; otherwise a ValueError saying what each
    choice would do."""
    pinned = trained.cosine_steps is not None or bool(trained.lr_extensions)
    if step <= trained.warmup_steps and not trained.lr_extensions:
        return "stretch"
    if pinned and _trains(options["keep"], step):
        return "keep"
    raise ValueError(
        f"--steps {N} changes the length of this run's learning-rate schedule (it was "
        f"planned over {trained.steps} steps; the run is at step {step}). Choose how to "
        "continue: "
        + "; ".join(f"--schedule {name} ({_describe(name, cfg, step)}"
                    + ("" if _trains(cfg, step) else
                       ": refused, it would train every step at learning rate 0")
                    + ")" for name, cfg in options.items())
        + ". Or start a new run from its weights: moeify train --init-from RUN")
