"""The demonstration's table and curves (called by demo.py's "report" stage).

Validation bpc: every run's final checkpoint on the same first 65,536 tokens of the validation
split (``moeify eval --task ppl``). Attention MACs: per layer and sequence, moeify.models.cost
(``moeify count``). Training time: the time spent in training steps (validation and checkpoints
excluded), summed from metrics.jsonl's tokens / tokens_per_s, on a shared 2-core machine, one
thread each (noisy: other jobs ran beside them); an upcycled or continued model includes the
dense model's N steps. Peak memory: tensor memory of a
training step at the runs' batch (16 x 128), weights, gradients and AdamW state included, in a
fresh process (moeify.bench.memory, the `moeify bench step` measurement).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EVAL_TOKENS = 65536
ROWS = [  # key, label, which runs' training time adds up to this model
    ("dense", "dense, N steps", ("dense",)),
    ("dense+", "dense, N + M steps (M with a fresh optimizer)", ("dense", "dense+")),
    ("switchhead-up", "SwitchHead upcycled from dense at N, + M steps", ("dense", "switchhead-up")),
    ("switchall-up", "SwitchAll upcycled from dense at N, + M steps", ("dense", "switchall-up")),
    ("switchhead-scratch", "SwitchHead from scratch, N + M steps", ("switchhead-scratch",)),
    ("switchall-scratch", "SwitchAll from scratch, N + M steps", ("switchall-scratch",)),
]


def _cached(path: Path, key: str, compute) -> float:
    """``compute()`` once per key, remembered in the JSON file ``path`` (stages run apart)."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    if key not in data:
        data = {**(json.loads(path.read_text()) if path.is_file() else {}), key: compute()}
        path.write_text(json.dumps(data, indent=2) + "\n")
    return data[key]


def eval_bpc(run: Path) -> float:
    """The final checkpoint's bpc on the table's validation tokens (cached in the runs dir)."""
    step = (run / "checkpoints" / "latest").read_text().strip()
    return _cached(run.parent / "evals.json", f"{run.name}@{step}", lambda: _eval_bpc(run))


def peak_mib(model_json: str, runs: Path) -> float:
    import hashlib

    key = hashlib.sha256(model_json.encode()).hexdigest()[:16]
    return _cached(runs / "peaks.json", key, lambda: _peak_mib(model_json))


def _eval_bpc(run: Path) -> float:
    r = subprocess.run(["nice", "-n", "10", sys.executable, "-m", "moeify.cli.main", "eval",
                        "--run", str(run), "--task", "ppl", "--split", "valid", "--limit",
                        str(EVAL_TOKENS), "--json"], check=True, capture_output=True, text=True,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    return json.loads(r.stdout)["bpc"]


def _peak_mib(model_json: str) -> float:
    from moeify.bench.memory import peak_memory

    ph = peak_memory("moeify.bench.step:step_phases",
                     dict(config_json=model_json, batch=16, steps=2), baseline="before_setup",
                     threads=1)
    return ph["step 2"]["peak"]


def train_seconds(run: Path) -> float:
    from moeify.train.metrics import read_metrics

    total, seen = 0.0, 0
    for r in sorted((r for r in read_metrics(run) if r["kind"] == "train"),
                    key=lambda r: r["step"]):
        total += (r["tokens"] - seen) / r["tokens_per_s"]
        seen = r["tokens"]
    return total


def _valid_curve(run: Path, offset: int) -> list[tuple[int, float]]:
    from moeify.train.metrics import read_metrics

    return [(r["step"] + offset, r["bpc"]) for r in read_metrics(run) if r["kind"] == "valid"]


def is_finished(run: Path) -> bool:
    from moeify.train.config import read_train_config

    latest = run / "checkpoints" / "latest"
    return latest.is_file() and latest.read_text().strip() == \
        f"step-{read_train_config(run).steps:08d}"


def report(runs: Path, names: dict[str, str], N: int, M: int, here: Path) -> None:
    from moeify.models.cost import format_count, model_cost
    from moeify.rundir import read_model_config

    peaks: dict[str, float] = {}
    rows = []
    for key, label, timed in ROWS:
        run = runs / names[key]
        if not is_finished(run):
            print(f"{run} is not finished: left out of the table")
            continue
        cfg = read_model_config(run)
        cost = model_cost(cfg)
        js = cfg.to_json()
        if js not in peaks:
            peaks[js] = peak_mib(js, runs)
        first = [r for r in _valid_curve(run, 0) if r[0] == 0]
        rows.append({
            "run": names[key], "model": label, "bpc": eval_bpc(run),
            "bpc_at_conversion": first[0][1] if first and key.endswith("-up") else None,
            "attention_macs": cost.layers[0]["macs"], "params": cost.params,
            "train_s": sum(train_seconds(runs / names[t]) for t in timed),
            "peak_mib": peaks[js]})
    base = rows[0]["attention_macs"] if rows else 1
    (here / "results.json").write_text(json.dumps({"N": N, "M": M, "eval_tokens": EVAL_TOKENS,
                                                    "rows": rows}, indent=2) + "\n")
    lines = [f"N = {N}, M = {M}; validation bpc on {EVAL_TOKENS:,} tokens of wiki-excerpt/valid "
             "(right after upcycling: the run's step-0 validation, on its first 16,384)",
             "", "| model | valid bpc | bpc right after upcycling | attention MACs / layer "
             "| params | training time | peak memory |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        conv = "" if r["bpc_at_conversion"] is None else f"{r['bpc_at_conversion']:.3f}"
        lines.append(f"| {r['model']} | {r['bpc']:.3f} | {conv} | "
                     f"{format_count(r['attention_macs'])} ({r['attention_macs'] / base:.0%}) | "
                     f"{format_count(r['params'])} | {r['train_s'] / 60:.1f} min | "
                     f"{r['peak_mib']:.0f} MiB |")
    table = "\n".join(lines) + "\n"
    (here / "results.md").write_text(table)
    print(table)
    _plot(runs, names, N, here)


def _plot(runs: Path, names: dict[str, str], N: int, here: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install -e '.[plot]' in the moeify checkout): no curves plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"dense": ("k", "-"), "dense+": ("k", "--"), "switchhead-up": ("tab:blue", "-"),
              "switchall-up": ("tab:red", "-"), "switchhead-scratch": ("tab:blue", ":"),
              "switchall-scratch": ("tab:red", ":")}
    for key, label, _ in ROWS:
        run = runs / names[key]
        if not (run / "checkpoints").is_dir():
            continue
        pts = _valid_curve(run, 0 if key in ("dense",) or key.endswith("scratch") else N)
        color, ls = styles[key]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=color, marker=".",
                label=label)
    ax.axvline(N, color="grey", lw=0.5)
    ax.set_xlabel("training steps (upcycled and continued runs: N dense steps first)")
    ax.set_ylabel("validation bpc")
    ax.set_ylim(top=min(ax.get_ylim()[1], 4.0))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(here / "curves.png", dpi=120)
    print(f"wrote {here / 'curves.png'}")


def report_moh(runs: Path, names: dict[str, str], conversions: dict[str, str], N: int, M: int,
               here: Path) -> None:
    """The MoH table (demo.py's "moh" stage): the bpc of the dense model, right after each
    attention conversion (its step-0 checkpoint, evaluated before training on) and after M more
    steps, on the same validation tokens, and the change right after the conversion in nats."""
    import math

    from moeify.models.cost import format_count, model_cost
    from moeify.rundir import read_model_config

    evals = json.loads((runs / "evals.json").read_text())
    dense = eval_bpc(runs / names["dense"])
    rows = [{"run": names["dense"], "model": "dense RoPE, N steps", "conversion": None,
             "bpc": dense, "bpc_at_conversion": None}]
    for key in ("dense+", *conversions):
        run = runs / names[key]
        if not is_finished(run):
            print(f"{run} is not finished: left out of the table")
            continue
        at = evals.get(f"{names[key]}@step-{0:08d}")
        rows.append({"run": names[key], "conversion": conversions.get(key),
                     "model": ("dense RoPE, N + M steps (M with a fresh optimizer)"
                               if key == "dense+" else f"`{conversions[key]}`, + M steps"),
                     "bpc": eval_bpc(run), "bpc_at_conversion": at})
    for r in rows:
        cfg = read_model_config(runs / r["run"])
        cost = model_cost(cfg)
        r.update(attention_macs=cost.layers[0]["macs"],
                 activated_head_macs=cost.layers[0].get("activated_head_macs"),
                 params=cost.params,
                 nats_at_conversion=None if r["bpc_at_conversion"] is None
                 else (r["bpc_at_conversion"] - dense) * math.log(2))
    base = rows[0]["attention_macs"]
    (here / "results-moh.json").write_text(json.dumps(
        {"N": N, "M": M, "eval_tokens": EVAL_TOKENS, "rows": rows}, indent=2) + "\n")
    lines = [f"N = {N}, M = {M}; validation bpc on {EVAL_TOKENS:,} tokens of "
             "wiki-excerpt/valid, every number on the same tokens",
             "", "| model | bpc right after upcycling | change right after (nats/token) | "
             "valid bpc after M steps | attention MACs / layer | activated-head MACs | params |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        at = "" if r["bpc_at_conversion"] is None else f"{r['bpc_at_conversion']:.3f}"
        dn = "" if r["nats_at_conversion"] is None else f"{r['nats_at_conversion']:+.3f}"
        act = r.get("activated_head_macs")
        sparse = "" if act is None else f"{format_count(act)} ({act / base:.0%})"
        lines.append(f"| {r['model']} | {at} | {dn} | {r['bpc']:.3f} | "
                     f"{format_count(r['attention_macs'])} ({r['attention_macs'] / base:.0%}) | "
                     f"{sparse} | {format_count(r['params'])} |")
    table = "\n".join(lines) + "\n"
    (here / "results-moh.md").write_text(table)
    print(table)
