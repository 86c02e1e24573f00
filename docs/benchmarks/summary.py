"""The median over runs of every ratio the benchmark tables of docs/benchmarks/index.md quote,
from the JSON files ``run.sh`` writes beside this script, and each speed target with its runs.
Markdown on stdout:

    python docs/benchmarks/summary.py > docs/benchmarks/summary.md
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent


def _runs(kind: str) -> list[dict]:
    files = sorted(HERE.glob(f"{kind}_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(p.read_text()) for p in files if p.stat().st_size]  # not one running


def _rows(result: dict) -> list[dict]:
    if "cells" in result:
        return [r for cell in result["cells"] for r in cell["rows"]]
    if "groups" in result:
        return [r for g in result["groups"] for r in g["rows"]]
    return result["rows"]


def _key(row: dict) -> tuple:
    return (row["case"], row.get("batch"), row.get("context"))


def collect(kind: str, columns: list[str]) -> list[tuple[tuple, dict[str, list[float]]]]:
    """Per row (in the first run's order): every column's values over the runs."""
    out: dict[tuple, dict[str, list[float]]] = {}
    for result in _runs(kind):
        for row in _rows(result):
            cols = out.setdefault(_key(row), {c: [] for c in columns})
            for c in columns:
                if row.get(c) is not None:
                    cols[c].append(row[c])
    return list(out.items())


def _fmt(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    each = " / ".join(f"{v:.3f}" for v in values)
    return f"**{med:.3f}** ({each})" if len(values) > 1 else f"{med:.3f}"


def table(kind: str, columns: list[str]) -> str:
    rows = collect(kind, columns)
    if not rows:
        return f"(no {kind} runs)\n"
    head = "| case | " + " | ".join(columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    for key, cols in rows:
        label = key[0] + (f", batch {key[1]}" if key[1] is not None else "") + \
            (f", context {key[2]}" if key[2] is not None else "")
        lines.append(f"| {label} | " + " | ".join(_fmt(cols[c]) for c in columns) + " |")
    return "\n".join(lines) + "\n"


# (what the target says, bench, row key, column, bound, "max" = at most / "min" = at least)
TARGETS = [
    ("sigma-MoE fwd+bwd <= HF's fastest", "ff", ("sigma-MoE", None, None), "fwd+bwd x HF best",
     1.0, "max"),
    ("dropless Switch fwd+bwd <= HF's fastest", "ff", ("Switch dropless", None, None),
     "fwd+bwd x HF best", 1.0, "max"),
    ("sigma-MoE <= 1.2x the equal-MAC dense MLP", "ff", ("sigma-MoE", None, None),
     "fwd+bwd x dense", 1.2, "max"),
    ("dropless Switch <= 1.2x the equal-MAC dense MLP", "ff", ("Switch dropless", None, None),
     "fwd+bwd x dense", 1.2, "max"),
    ("SwitchHead decode >= 1.5x dense, context 2048, batch 1", "generate",
     ("wt103-47m-switchhead", 1, 2048), "decode x", 1.5, "min"),
    ("SwitchHead decode >= 1.5x dense, context 2048, batch 8", "generate",
     ("wt103-47m-switchhead", 8, 2048), "decode x", 1.5, "min"),
    ("SwitchHead KV cache <= 0.25x dense", "generate", ("wt103-47m-switchhead", 1, 2048),
     "KV x", 0.25, "max"),
    ("47M SwitchHead attention layer fwd+bwd <= 0.45x dense", "attention",
     ("wt103-47m-switchhead", None, None), "fwd+bwd x", 0.45, "max"),
    ("47M step <= 0.65x dense time (batch 4)", "step", ("wt103-47m-switchhead", None, None),
     "time x", 0.65, "max"),
    ("47M step <= 0.70x dense peak memory (batch 4)", "step",
     ("wt103-47m-switchhead", None, None), "peak x", 0.70, "max"),
]


def targets() -> str:
    lines = ["| target | runs | median | met |", "|---|---|---|---|"]
    for what, kind, key, col, bound, sense in TARGETS:
        values = [row[col] for result in _runs(kind) for row in _rows(result)
                  if _key(row) == key and row.get(col) is not None]
        if not values:
            lines.append(f"| {what} | - | - | not measured |")
            continue
        med = statistics.median(values)
        met = med <= bound if sense == "max" else med >= bound
        lines.append(f"| {what} | {' / '.join(f'{v:.3f}' for v in values)} | {med:.3f} | "
                     f"{'yes' if met else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    machine = {}
    for kind in ("ff", "generate", "attention", "step"):
        runs = _runs(kind)
        if runs:
            machine[kind] = (len(runs), runs[0].get("threads"), runs[0].get("omp_wait_policy"))
    parts = ["# Benchmark summary (medians over runs; each run in parentheses)\n",
             "Runs, threads and OpenMP wait policy per benchmark: "
             + "; ".join(f"{k}: {n} runs, {t} threads, {w}" for k, (n, t, w) in machine.items())
             + ".\n",
             "## Targets\n", targets(),
             "## Feedforward MoEs (`bench ff`)\n",
             table("ff", ["fwd x dense", "fwd+bwd x dense", "fwd+bwd x HF best", "cpu x dense"]),
             "## Decoding at context 2048 (`bench generate`)\n",
             table("generate", ["decode ms", "decode x", "prefill x", "KV MiB", "KV x"]),
             "## One attention layer (`bench attention`)\n",
             table("attention", ["fwd+bwd ms", "fwd+bwd x", "fwd x", "MACs x", "peak MiB"]),
             "## Training step, batch 4 (`bench step`)\n",
             table("step", ["step ms", "time x", "peak MiB", "peak x", "model MACs x"])]
    sys.stdout.write("\n".join(parts))


if __name__ == "__main__":
    main()
