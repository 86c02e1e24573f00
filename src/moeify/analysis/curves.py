"""Training and validation curves of several runs on shared axes.

Reads each run's metrics.jsonl (moeify.train.metrics): "train" records carry the training
tokens seen so far, the mean loss over the logging window and that window's tokens/s; "valid"
records carry the validation score at a step. The metric is bits per character (``bpc``) for
byte-level runs and perplexity (``ppl``) otherwise, whichever the records hold.

Wall time is training time: the sum over logging windows of tokens / (tokens/s), so validation
and checkpointing pauses do not count, and runs that shared a busy machine with different
validation schedules stay comparable. A record's own ``elapsed_s`` is used when present.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeify.analysis.plotting import pyplot, save_figure
from moeify.rundir.files import read_metrics
from moeify.errors import MoeifyError


@dataclass
class Curve:
    """One run's series: x values (training tokens and training seconds) and the metric."""

    label: str
    metric: str
    train_tokens: list[float] = field(default_factory=list)
    train_time: list[float] = field(default_factory=list)
    train_value: list[float] = field(default_factory=list)
    valid_tokens: list[float] = field(default_factory=list)
    valid_time: list[float] = field(default_factory=list)
    valid_value: list[float] = field(default_factory=list)
    valid_step: list[int] = field(default_factory=list)

    @property
    def final_valid(self) -> float | None:
        return self.valid_value[-1] if self.valid_value else None


def metric_of(records: list[dict[str, Any]]) -> str:
    for r in records:
        for name in ("bpc", "ppl"):
            if name in r:
                return name
    raise MoeifyError("the metrics hold neither bpc nor ppl: not a moeify training log")


def training_clock(records: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(step, training tokens, training seconds) at every train record (see module doc)."""
    out = []
    tokens, clock = 0.0, 0.0
    for r in records:
        if r.get("kind") != "train":
            continue
        t = float(r.get("tokens", tokens))
        if "elapsed_s" in r:
            clock = float(r["elapsed_s"])
        elif r.get("tokens_per_s"):
            clock += (t - tokens) / float(r["tokens_per_s"])
        tokens = t
        out.append((int(r.get("step", 0)), tokens, clock))
    return out


def curve_from_records(records: list[dict[str, Any]], label: str,
                       metric: str | None = None) -> Curve:
    """A Curve from metrics records (see module doc for how time is reconstructed)."""
    metric = metric or metric_of(records)
    c = Curve(label=label, metric=metric)
    clock = training_clock(records)
    train = [r for r in records if r.get("kind") == "train"]
    for (step, tokens, seconds), r in zip(clock, train):
        if r.get(metric) is not None:
            c.train_tokens.append(tokens)
            c.train_time.append(seconds)
            c.train_value.append(float(r[metric]))
    steps = [s for s, _, _ in clock]
    for r in records:
        if r.get("kind") != "valid" or r.get(metric) is None:
            continue
        step = int(r.get("step", 0))
        # The latest training record at or before this step gives its tokens and time.
        i = max((j for j, s in enumerate(steps) if s <= step), default=None)
        c.valid_step.append(step)
        c.valid_tokens.append(clock[i][1] if i is not None else 0.0)
        c.valid_time.append(clock[i][2] if i is not None else 0.0)
        c.valid_value.append(float(r[metric]))
    return c


def load_curve(run_dir: str | Path, label: str | None = None) -> Curve:
    records = read_metrics(run_dir)
    if not records:
        raise MoeifyError(f"{run_dir}/metrics.jsonl holds no records yet")
    return curve_from_records(records, label or Path(run_dir).name)


PANELS = ("training {m} vs tokens", "validation {m} vs tokens",
          "training {m} vs training time", "validation {m} vs training time")


def plot_curves(curves: list[Curve], out: str | Path, *, title: str | None = None,
                log_y: bool | None = None) -> Path:
    """Four panels: training and validation metric against training tokens and against
    training time, one line per run."""
    if not curves:
        raise ValueError("give at least one run to plot")
    metrics = {c.metric for c in curves}
    if len(metrics) != 1:
        raise MoeifyError(f"the runs report different metrics ({', '.join(sorted(metrics))}): "
                          "plot byte-level (bpc) and tokenised (ppl) runs separately")
    m = metrics.pop()
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    titles = [p.format(m=m) for p in PANELS]
    series = (("train_tokens", "train_value"), ("valid_tokens", "valid_value"),
              ("train_time", "train_value"), ("valid_time", "valid_value"))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, t, (xs, ys) in zip(axes.flat, titles, series):
        # The first quarter of training drops far more than runs differ later: leave it out of
        # the y range (the lines still start there) so the differences that matter are visible.
        tail = [v for c in curves for v in getattr(c, ys)[len(getattr(c, ys)) // 4:]]
        for i, c in enumerate(curves):
            x, y = getattr(c, xs), getattr(c, ys)
            if not x:
                continue
            style = "-o" if xs.startswith("valid") else "-"
            ax.plot(x, y, style, color=colors[i % len(colors)], label=c.label, markersize=3,
                    linewidth=1.2)
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("training tokens" if "tokens" in xs else "training time (s)", fontsize=8)
        ax.set_ylabel(m, fontsize=8)
        if log_y or (log_y is None and m == "ppl"):
            ax.set_yscale("log")
        if len(tail) >= 4 and max(tail) > min(tail):
            pad = 0.05 * (max(tail) - min(tail))
            ax.set_ylim(min(tail) - pad, max(tail) + pad)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes.flat[1].legend(fontsize=7)
    fig.suptitle(title or "training curves", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, out, titles)
