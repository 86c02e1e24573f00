"""Tabulating a sweep: runs of presets x training budgets x seeds (x named setting variants).

Each finished run gives one record (``run_record`` of moeify.analysis.compare plus its
variant, budget and seed). Runs of the same (variant, steps, preset) form a cell:

    mean     the mean of the final validation score over the cell's seeds;
    se       its standard error, sd / sqrt(n) with the n - 1 sample standard deviation (None for
             one seed);
    gap      the cell's mean minus its baseline's (same variant and steps), **paired by seed**:
             over the seeds both cells have, d_s = score(preset, s) - score(baseline, s), gap =
             mean(d_s), gap_se = sd(d_s) / sqrt(n). Pairing removes what a seed does to both
             models alike (the same initialisation seed and the same token order).

The baseline of a preset is the first of the named baselines with the same family (the part of
the name before the first "-": repro-switchhead -> repro, repro256-moa -> repro256), else the
first baseline.

Routing diagnosis (SwitchHead runs): the trainer logs, per routing side S (src: V/K, dst: O/Q),
``stats/layers.I.attn.S.counts`` (selections per head and expert in the logged step's batch,
[H, E] flattened) and ``stats/layers.I.attn.S.gate_mean`` (mean selected gate) in
metrics.jsonl; logs of older versions name them per projection P
(``stats/layers.I.attn.sel_P_counts``, ``..._gate_mean``), which is read too.
``routing_diagnosis`` turns them into, per layer and logged step: the usage entropy of each head
normalised by log E (1 = uniform, 0 = one expert), averaged over heads; the number of experts
that no token of that batch selected ("dead in the batch"); and the mean gate.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from moeify.analysis.curves import load_curve
from moeify.analysis.plotting import pyplot, save_figure
from moeify.data.cache import atomic_write
from moeify.rundir.files import check_run_dir, read_metrics, read_model_config


def mean_se(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and standard error of the mean (n - 1 sample sd; None below two values)."""
    if not values:
        return None, None
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def family(preset: str) -> str:
    return preset.split("-", 1)[0]


def baseline_for(preset: str, baselines: list[str]) -> str | None:
    same = [b for b in baselines if family(b) == family(preset)]
    return same[0] if same else (baselines[0] if baselines else None)


def cell_key(r: dict[str, Any]) -> tuple[str, int, str]:
    return (r["variant"], int(r["steps"]), r["preset"])


def sweep_table(records: list[dict[str, Any]], baselines: list[str]) -> list[dict[str, Any]]:
    """One row per (variant, steps, preset) with mean, se and the paired gap (module doc)."""
    cells: dict[tuple[str, int, str], dict[int, dict[str, Any]]] = {}
    for r in records:
        cells.setdefault(cell_key(r), {})[int(r["seed"])] = r
    rows = []
    for (variant, steps, preset), by_seed in sorted(cells.items(),
                                                    key=lambda kv: (kv[0][0], kv[0][1])):
        seeds = sorted(by_seed)
        values = [by_seed[s]["final_valid"] for s in seeds]
        mean, se = mean_se(values)
        base = baseline_for(preset, baselines)
        gap = gap_se = None
        gap_n = 0
        if base is not None and base != preset and (variant, steps, base) in cells:
            other = cells[(variant, steps, base)]
            diffs = [by_seed[s]["final_valid"] - other[s]["final_valid"]
                     for s in seeds if s in other]
            gap, gap_se = mean_se(diffs)
            gap_n = len(diffs)
        first = by_seed[seeds[0]]
        rows.append({"variant": variant, "steps": steps, "preset": preset, "n": len(seeds),
                     "seeds": seeds, "values": values, "mean": mean, "se": se,
                     "baseline": base if base != preset else None, "gap": gap,
                     "gap_se": gap_se, "gap_n": gap_n, "params": first["params"],
                     "attention_macs": first["attention_macs"],
                     "train_tokens": first["train_tokens"],
                     "train_time_s": mean_se([by_seed[s]["train_time_s"] for s in seeds])[0],
                     "metric": first["metric"]})
    _order_by_preset(rows, records)
    return rows


def _order_by_preset(rows: list[dict[str, Any]], records: list[dict[str, Any]]) -> None:
    order = {}
    for r in records:
        order.setdefault(r["preset"], len(order))
    rows.sort(key=lambda r: (r["variant"], r["steps"], order[r["preset"]]))


def _pm(m: float | None, se: float | None, spec: str = ".4f", sign: bool = False) -> str:
    if m is None:
        return "-"
    text = format(m, ("+" if sign else "") + spec)
    return text + (f" ± {format(se, spec)}" if se is not None else "")


def sweep_markdown(rows: list[dict[str, Any]], settings: dict[str, Any],
                   diagnosis: list[dict[str, Any]], plots: list[str],
                   pending: list[str]) -> str:
    metric = rows[0]["metric"] if rows else "bpc"
    lines = ["# moeify sweep", "",
             "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()), "",
             f"Final validation {metric}: mean ± standard error over seeds; gap: mean minus the "
             "baseline's, paired by seed (mean ± standard error of the per-seed differences "
             "over the n shared seeds).", "",
             f"| variant | steps | preset | params | attn MACs / layer | seeds | valid {metric} | "
             "gap to baseline | n | training time |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        macs = r["attention_macs"]
        gap = (_pm(r["gap"], r["gap_se"], sign=True) + f" vs {r['baseline']}"
               if r["gap"] is not None else "-")
        lines.append(
            f"| {r['variant']} | {r['steps']} | {r['preset']} | {r['params']:,} | "
            f"{f'{macs:,}' if isinstance(macs, int) else macs} | "
            f"{','.join(map(str, r['seeds']))} | {_pm(r['mean'], r['se'])} | {gap} | "
            f"{r['gap_n'] or '-'} | {_fmt_time(r['train_time_s'])} |")
    lines += ["", "Per-seed values:", ""]
    for r in rows:
        vals = ", ".join(f"seed {s}: {v:.4f}" for s, v in zip(r["seeds"], r["values"]))
        lines.append(f"- {r['variant']} / {r['steps']} steps / {r['preset']}: {vals}")
    if diagnosis:
        lines += ["", "## Routing (SwitchHead runs)", "",
                  "Per layer at the first, middle and last logged step: usage entropy over the "
                  "E experts of each head / log E, averaged over heads and over the cell's "
                  "seeds; experts no token of that step's batch selected (summed over heads, "
                  "mean over seeds); mean selected gate.", "",
                  "| variant | steps | preset | proj. | layer | entropy (first / mid / last) | "
                  "dead in batch (first / mid / last) | gate (first / mid / last) |",
                  "|---|---|---|---|---|---|---|---|"]
        for d in diagnosis:
            lines.append(
                f"| {d['variant']} | {d['steps']} | {d['preset']} | {d['proj']} | {d['layer']} | "
                + " | ".join("/".join("-" if v is None else f"{v:.3g}" for v in d[k])
                             for k in ("entropy", "dead", "gate")) + " |")
    if pending:
        lines += ["", "Not finished (not in the table): " + ", ".join(pending) + "."]
    lines += [""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def main_table(markdown: str) -> str:
    """What ``moeify sweep`` prints of its results.md: the title and the first table (means and
    gaps), pointing at the rest (settings, per-seed values, routing) in the file."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        return markdown
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join([lines[0], "", *lines[start:end], "",
                      "(settings, per-seed values and routing: results.md)"])


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


# ---------------------------------------------------------------------------- routing

# Two spellings of the same statistics: per routing record and side ("attn.src.counts",
# "attn.dst.gate_mean"), and the older per projection one ("attn.sel_v_counts",
# "attn.sel_o_gate_mean"); both are [H, E] counts (flattened) and [H] or scalar mean gates.
_SEL = re.compile(r"^stats/layers\.(\d+)\.attn\.(?:sel_([qkvo])_|(src|dst)\.)(counts|gate_mean)$")


def routing_series(run_dir: str | Path) -> dict[tuple[int, str], dict[str, list]]:
    """{(layer, projection): {"step", "entropy", "dead", "gate"}} over the logged steps of one
    run (module doc); empty for runs without SwitchHead statistics."""
    cfg = read_model_config(check_run_dir(run_dir))
    out: dict[tuple[int, str], dict[str, list]] = {}
    for rec in read_metrics(run_dir):
        if rec.get("kind") != "train":
            continue
        for key, value in rec.items():
            m = _SEL.match(key)
            if not m or value is None:
                continue
            layer, proj, what = int(m.group(1)), m.group(2) or m.group(3), m.group(4)
            if what == "counts" and not isinstance(value, list):
                continue
            s = out.setdefault((layer, proj), {"step": [], "entropy": [], "dead": [],
                                               "gate": []})
            if what == "counts":
                E = _n_experts(cfg, layer)
                s["step"].append(int(rec["step"]))
                ent, dead = _entropy_dead(value, E)
                s["entropy"].append(ent)
                s["dead"].append(dead)
            else:
                s["gate"].append(sum(value) / len(value) if isinstance(value, list) else value)
    return out


def _n_experts(cfg: Any, layer: int) -> int:
    attn = cfg.attention[layer % len(cfg.attention)]
    return int(attn.n_experts)


def _entropy_dead(counts: list[float], E: int) -> tuple[float, int]:
    heads = [counts[i:i + E] for i in range(0, len(counts), E)]
    ents, dead = [], 0
    for h in heads:
        total = sum(h)
        dead += sum(1 for c in h if c == 0)
        p = [c / total for c in h if c > 0] if total else []
        ents.append(-sum(q * math.log(q) for q in p) / math.log(E) if E > 1 else 1.0)
    return sum(ents) / len(ents), dead


def routing_diagnosis(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (variant, steps, preset, projection, layer): entropy, dead and gate at the first,
    middle and last logged step, averaged over the cell's seeds."""
    acc: dict[tuple, dict[str, list[list[float]]]] = {}
    for r in records:
        for (layer, proj), s in routing_series(r["run_dir"]).items():
            if not s["step"]:
                continue
            n = len(s["step"])
            picks = (0, n // 2, n - 1)
            key = cell_key(r) + (proj, layer)
            a = acc.setdefault(key, {"entropy": [], "dead": [], "gate": []})
            for k in a:
                series = s[k]
                a[k].append([series[i] if i < len(series) else None for i in picks])
    out = []
    for (variant, steps, preset, proj, layer), a in sorted(acc.items()):
        row = {"variant": variant, "steps": steps, "preset": preset, "proj": proj,
               "layer": layer}
        for k, per_seed in a.items():
            row[k] = [_mean_or_none([v[i] for v in per_seed]) for i in range(3)]
        out.append(row)
    return out


def _mean_or_none(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


# ---------------------------------------------------------------------------- plots


def plot_sweep(records: list[dict[str, Any]], out: str | Path) -> Path:
    """Validation score against training tokens and against training time: one line per run,
    a colour per preset and a line style per budget, one figure row per variant."""
    plt = pyplot()
    variants = sorted({r["variant"] for r in records})
    presets = list(dict.fromkeys(r["preset"] for r in records))
    budgets = sorted({int(r["steps"]) for r in records})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(len(variants), 2, figsize=(12, 4.2 * len(variants)), squeeze=False)
    metric = records[0]["metric"]
    for row, variant in zip(axes, variants):
        labelled = set()
        for r in records:
            if r["variant"] != variant:
                continue
            c = load_curve(r["run_dir"], r["preset"])
            color = colors[presets.index(r["preset"]) % len(colors)]
            style = styles[budgets.index(int(r["steps"])) % len(styles)]
            label = f"{r['preset']} {r['steps']} steps"
            for ax, xs in zip(row, (c.valid_tokens, c.valid_time)):
                ax.plot(xs, c.valid_value, style, color=color, linewidth=1.0, alpha=0.8,
                        label=None if label in labelled else label)
            labelled.add(label)
        for ax, xl in zip(row, ("training tokens", "training time (s)")):
            ax.set_xlabel(xl, fontsize=8)
            ax.set_ylabel(f"validation {metric}", fontsize=8)
            ax.set_title(f"{variant}: validation {metric} vs {xl}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            _tail_ylim(ax)
        row[0].legend(fontsize=6)
    fig.tight_layout()
    return save_figure(fig, out, [f"validation {metric} vs tokens / time"])


def _tail_ylim(ax) -> None:
    # The first quarter of each line drops far more than the runs differ later.
    ys = [y for line in ax.get_lines() for y in list(line.get_ydata())[len(line.get_ydata()) // 4:]]
    if len(ys) >= 4 and max(ys) > min(ys):
        pad = 0.05 * (max(ys) - min(ys))
        ax.set_ylim(min(ys) - pad, max(ys) + pad)


def _mean_series(runs: list[dict[str, list]], k: str) -> tuple[list[int], list[float]]:
    """The seeds' series averaged at the steps they all logged."""
    steps = sorted(set.intersection(*(set(r["step"][:len(r[k])]) for r in runs)))
    at = [dict(zip(r["step"], r[k])) for r in runs]
    return steps, [sum(a[s] for a in at) / len(at) for s in steps]


def plot_routing(records: list[dict[str, Any]], out: str | Path) -> Path | None:
    """Usage entropy, experts unselected in the batch and mean gate per layer over training:
    one row per cell with SwitchHead statistics (mean over its seeds), a colour per layer."""
    cells: dict[tuple, dict[tuple[int, str], list[dict[str, list]]]] = {}
    for r in records:
        for lp, d in routing_series(r["run_dir"]).items():
            if d["step"]:
                cells.setdefault(cell_key(r), {}).setdefault(lp, []).append(d)
    if not cells:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(len(cells), 3, figsize=(14, 3.2 * len(cells)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    titles = ("usage entropy / log E (mean over heads)", "experts unselected in the batch",
              "mean selected gate")
    for row, ((variant, steps, preset), by_layer) in zip(axes, sorted(cells.items())):
        for (layer, proj), runs in sorted(by_layer.items()):
            for ax, k in zip(row, ("entropy", "dead", "gate")):
                if all(r[k] for r in runs):
                    x, y = _mean_series(runs, k)
                    ax.plot(x, y, color=colors[layer % len(colors)], linewidth=0.9,
                            linestyle="-" if proj in ("v", "k", "src") else "--",
                            label=f"layer {layer} {proj.upper() if len(proj) == 1 else proj}")
        for ax, t in zip(row, titles):
            ax.set_title(f"{preset} {variant} {steps} steps: {t}", fontsize=8)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
        row[0].legend(fontsize=6)
    fig.tight_layout()
    return save_figure(fig, out, ["routing over training"])


def plot_gaps(rows: list[dict[str, Any]], out: str | Path) -> Path | None:
    """The gap to the baseline (± standard error, paired by seed) against the training budget,
    one line per (variant, preset); None when no cell has a gap."""
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["gap"] is not None:
            lines.setdefault((r["variant"], r["preset"]), []).append(r)
    if not lines:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (variant, preset), rs in sorted(lines.items()):
        rs = sorted(rs, key=lambda r: r["steps"])
        ax.errorbar([r["steps"] for r in rs], [r["gap"] for r in rs],
                    yerr=[r["gap_se"] or 0.0 for r in rs], marker="o", capsize=3,
                    linewidth=1.0, label=f"{preset} - {rs[0]['baseline']} ({variant})")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("training steps", fontsize=8)
    ax.set_ylabel(f"gap in validation {rows[0]['metric']}", fontsize=8)
    ax.set_title("gap to the baseline against the budget (± s.e., paired by seed)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    return save_figure(fig, out, ["gap vs budget"])


def write_json(path: Path, data: Any) -> None:
    with atomic_write(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")


def write_text(path: Path, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)
