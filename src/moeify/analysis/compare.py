"""Comparing trained runs of several presets: one results record per run, the ordering of their
validation scores and how stable it is, results.json, results.md and the curves plot.

Each record holds (RESULT_FIELDS): parameters, attention MACs and memory per layer for one
sequence (moeify.models.cost, as ``moeify count`` prints them; ``*_total`` sums the layers), the
final
validation score on the scored part of the validation split (bpc for byte-level runs, else
perplexity), training tokens/s (tokens over training time, validation and checkpoints
excluded), the peak memory of the training process, and BLiMP accuracy (None with a reason
when BLiMP data is absent). The training run itself is done by the caller (``moeify compare``):
this module reads run directories and the caller's measurements only.

Ordering stability: the runs are ranked by validation score at each of the last K validation
points they share; the ordering is "stable" when every one of those rankings is the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeify.analysis.curves import Curve, load_curve, plot_curves, training_clock
from moeify.rundir.files import (check_run_dir, read_metrics, read_model_config,
                                 read_train_config_dict)
from moeify.data.cache import atomic_write
from moeify.errors import MoeifyError
from moeify.models.cost import format_count, model_cost

RESULT_FIELDS = ("preset", "params", "attention_macs", "attention_memory",
                 "attention_macs_total", "attention_memory_total", "metric", "final_valid",
                 "final_valid_loss", "valid_tokens", "train_tokens", "train_time_s",
                 "tokens_per_s", "peak_memory_bytes", "peak_memory_kind", "blimp_accuracy",
                 "blimp_pairs", "run_dir")


def training_throughput(records: list[dict[str, Any]]) -> tuple[float, float]:
    """(training tokens, training seconds) from a run's train records (see curves.py)."""
    clock = training_clock(records)
    return (clock[-1][1], clock[-1][2]) if clock else (0.0, 0.0)


def run_record(preset: str, run_dir: str | Path, *, final_valid: dict[str, Any] | None = None,
               peak_memory_bytes: int | None = None, peak_memory_kind: str = "max RSS",
               blimp: dict[str, Any] | None = None,
               listops: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every RESULT_FIELDS entry for one trained run.

    ``final_valid``: {"loss", "bpc" or "ppl", "tokens"} of a final evaluation (default: the
    run's last validation record). ``blimp``: blimp_accuracy's result, or {"error": reason}.
    ``listops``: listops_accuracy's result for runs on ListOps (adds ``answer_accuracy``,
    ``majority_baseline`` and ``answer_examples``)."""
    cfg = read_model_config(check_run_dir(run_dir))
    cost = model_cost(cfg)
    records = read_metrics(run_dir)
    if final_valid is None:
        valid = [r for r in records if r.get("kind") == "valid"]
        final_valid = valid[-1] if valid else {}
    metric = "bpc" if "bpc" in final_valid else "ppl"
    tokens, seconds = training_throughput(records)
    macs = [layer["macs"] for layer in cost.layers]
    mem = [layer["memory"] for layer in cost.layers]
    blimp = blimp or {"error": "not evaluated"}
    extra = {} if not listops else {
        "answer_accuracy": listops["accuracy"], "majority_baseline": listops["majority_baseline"],
        "answer_examples": listops["n"], "answer_seen_in_train": listops.get("seen_fraction"),
        "answer_accuracy_unseen": listops.get("accuracy_unseen"),
        "majority_baseline_unseen": listops.get("majority_baseline_unseen")}
    return {**extra, 
        "preset": preset,
        "params": cost.params,
        "attention_macs": macs[0] if len(set(macs)) == 1 else macs,
        "attention_memory": mem[0] if len(set(mem)) == 1 else mem,
        "attention_macs_total": sum(macs),
        "attention_memory_total": sum(mem),
        "metric": metric,
        "final_valid": final_valid.get(metric),
        "final_valid_loss": final_valid.get("loss"),
        "valid_tokens": final_valid.get("tokens"),
        "train_tokens": tokens,
        "train_time_s": seconds,
        "tokens_per_s": tokens / seconds if seconds else None,
        "peak_memory_bytes": peak_memory_bytes,
        "peak_memory_kind": peak_memory_kind,
        "blimp_accuracy": blimp.get("accuracy"),
        "blimp_pairs": blimp.get("pairs") if "accuracy" in blimp else blimp.get("error"),
        "run_dir": str(run_dir),
    }


@dataclass
class Ordering:
    """Rankings (best first) at each of the last shared validation steps."""

    steps: list[int]
    rankings: list[list[str]]

    @property
    def stable(self) -> bool:
        return len(self.rankings) > 0 and all(r == self.rankings[0] for r in self.rankings)

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "rankings": self.rankings, "stable": self.stable}


def ordering_over_last(curves: dict[str, Curve], last_k: int = 3) -> Ordering:
    """Rank the runs (lower is better) at each of the last ``last_k`` validation steps that
    every run has."""
    if not curves:
        return Ordering([], [])
    shared = set.intersection(*(set(c.valid_step) for c in curves.values()))
    steps = sorted(shared)[-last_k:] if last_k > 0 else []
    rankings = []
    for s in steps:
        value = {name: c.valid_value[c.valid_step.index(s)] for name, c in curves.items()}
        rankings.append(sorted(value, key=value.get))
    return Ordering(steps, rankings)


def valid_text(valid: dict[str, Any] | None) -> str:
    """A run's final validation as words: "valid bpc 3.2841 (loss 2.2764 over 65,536 tokens)"."""
    if not valid:
        return "no validation"
    name = "bpc" if "bpc" in valid else "ppl"
    head = f"valid {name} {valid[name]:.4f}" if name in valid else "valid"
    rest = [f"loss {valid['loss']:.4f}"] if "loss" in valid else []
    if "tokens" in valid:
        rest.append(f"over {valid['tokens']:,} tokens")
    return head + (f" ({' '.join(rest)})" if rest else "")


def _fmt(x: Any, spec: str = ".4f") -> str:
    if x is None:
        return "-"
    if isinstance(x, list):
        return "/".join(_fmt(v, spec) for v in x)
    return format(x, spec)


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def results_markdown(rows: list[dict[str, Any]], settings: dict[str, Any],
                     ordering: Ordering, curves_png: str | None) -> str:
    """results.md: settings, the table, the ordering and its stability."""
    metric = rows[0]["metric"] if rows else "bpc"
    base = rows[0] if rows else None
    lines = ["# moeify compare", "",
             "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()), "",
             f"| preset | params | attn MACs / layer | attn memory / layer | valid {metric} | "
             f"tokens/s | peak memory | BLiMP |",
             "|---|---|---|---|---|---|---|---|"]
    answers = any("answer_accuracy" in r for r in rows)
    if answers:
        lines[4] += " answer acc. (unseen) | majority class (unseen) |"
        lines[5] += "---|---|"
    for r in rows:
        macs = r["attention_macs"]
        mem = r["attention_memory"]
        rel = ""
        if base is not None and isinstance(macs, int) and isinstance(base["attention_macs"], int):
            rel = f" ({macs / base['attention_macs']:.2f}x)"
        tps = r["tokens_per_s"]
        tps_rel = ""
        if base is not None and tps and base["tokens_per_s"]:
            tps_rel = f" ({tps / base['tokens_per_s']:.2f}x)"
        peak = r["peak_memory_bytes"]
        blimp = r["blimp_accuracy"]
        lines.append(
            f"| {r['preset']} | {r['params']:,} | "
            f"{format_count(macs) if isinstance(macs, int) else macs}{rel} | "
            f"{format_count(mem) if isinstance(mem, int) else mem} | "
            f"{_fmt(r['final_valid'])} | {_fmt(tps, '.0f')}{tps_rel} | "
            f"{'-' if peak is None else f'{peak / 2**20:.0f} MiB'} | "
            f"{'-' if blimp is None else f'{100 * blimp:.1f}%'} |"
            + (f" {_pct(r['answer_accuracy'])} ({_pct(r['answer_accuracy_unseen'])}) | "
               f"{_pct(r['majority_baseline'])} ({_pct(r['majority_baseline_unseen'])}) |"
               if answers and "answer_accuracy" in r else (" - | - |" if answers else "")))
    lines += ["", f"Ratios in brackets are relative to the first preset ({base['preset']})."
              if base else "", ""]
    if ordering.steps:
        lines.append(f"Ordering by validation {metric} (best first) at the last "
                     f"{len(ordering.steps)} shared validation steps:")
        lines.append("")
        for s, rk in zip(ordering.steps, ordering.rankings):
            lines.append(f"- step {s}: {' < '.join(rk)}")
        lines += ["", f"Stable over these points: {'yes' if ordering.stable else 'no'}.", ""]
    if rows and rows[0].get("peak_memory_kind"):
        lines.append(f"Peak memory is the training process's {rows[0]['peak_memory_kind']}; "
                     "tokens/s excludes validation and checkpointing.")
    if any(r["blimp_accuracy"] is None for r in rows):
        reasons = {r["blimp_pairs"] for r in rows if r["blimp_accuracy"] is None}
        lines.append(f"BLiMP not scored: {'; '.join(str(x) for x in reasons)}.")
    if answers:
        seen = [r.get("answer_seen_in_train") for r in rows if "answer_accuracy" in r]
        lines.append(f"Answer accuracy: the most probable digit after ' = ' on the validation "
                     f"examples; 'unseen' counts only expressions absent from the training split "
                     f"({_pct(1 - seen[0]) if seen and seen[0] is not None else '-'} of them).")
    if curves_png:
        lines += ["", f"![curves]({curves_png})"]
    return "\n".join(lines) + "\n"


def write_results(out_dir: str | Path, rows: list[dict[str, Any]], settings: dict[str, Any],
                  *, last_k: int = 3) -> dict[str, Any]:
    """Write results.json, results.md and curves.png into ``out_dir``; return the JSON data."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    curves = {r["preset"]: load_curve(r["run_dir"], r["preset"]) for r in rows}
    ordering = ordering_over_last(curves, last_k)
    curves_png, errors = None, []
    if rows:
        try:
            plot_curves(list(curves.values()), out_dir / "curves.png",
                        title="moeify compare: " + ", ".join(curves))
            curves_png = "curves.png"
        except MoeifyError as e:  # matplotlib missing: the numbers still get written
            errors.append(f"curves.png not drawn: {e}")
    data = {"settings": settings, "plots": [curves_png] if curves_png else [],
            "plot_errors": errors, "fields": list(RESULT_FIELDS), "results": rows,
            "ordering": ordering.to_dict(),
            "valid_curves": {n: {"step": c.valid_step, "tokens": c.valid_tokens,
                                 c.metric: c.valid_value} for n, c in curves.items()},
            "train_configs": {r["preset"]: read_train_config_dict(check_run_dir(r["run_dir"]))
                              for r in rows}}
    md = results_markdown(rows, settings, ordering, curves_png)
    if errors:
        md += "\n" + "\n".join(errors) + "\n"
    with atomic_write(out_dir / "results.json", "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
    with atomic_write(out_dir / "results.md", "w") as f:
        f.write(md)
    return data
