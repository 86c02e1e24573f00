"""``moeify sweep``: a grid of presets x training budgets x seeds (x named setting variants),
trained one run per child process as ``moeify compare`` does (the same scheduler, child and
run-directory rules: moeify.sweep.scheduler), then tabulated by moeify.analysis.sweep.

Runs live in OUT/runs/VARIANT/PRESET/steps-N/seed-S. A run is finished when its directory holds
the child's result with the same settings; a finished run is never trained again, an interrupted
one resumes from its last checkpoint, so a killed sweep continues where it stopped. The table
covers every finished run under OUT/runs (several invocations may fill one OUT, e.g. more seeds
or presets later); ``tabulate`` only rewrites it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moeify.analysis.compare import run_record
from moeify.analysis.sweep import (plot_gaps, plot_routing, plot_sweep, routing_diagnosis,
                                   sweep_markdown, sweep_table, write_text)
from moeify.data import load_corpus
from moeify.errors import MoeifyError
from moeify.sweep.protocol import CHILD_RESULT, SPEC_FILE, Scoring, run_spec, write_json
from moeify.sweep.scheduler import plan_run, run_settings, train_all
from moeify.train.config import TrainConfig, resolve_model_config

SWEEP_FILE = "sweep.json"


def grid_specs(out: Path, presets: list[str], budgets: list[int], seeds: list[int],
               variants: dict[str, list[str]], threads: int, *, data: str,
               overrides: list[str], scoring: Scoring) -> list[dict]:
    """One spec per run, ordered budget, seed, variant, preset: the cheapest complete
    comparisons first, and a seed's presets side by side. ``variants``: name -> the settings
    it adds to ``overrides`` ("base": none)."""
    specs, lengths = [], set()
    for steps in budgets:
        for seed in seeds:
            for vname, vsets in variants.items():
                for preset in presets:
                    cfg = TrainConfig(preset=preset, data=data, steps=steps,
                                      seed=seed).with_overrides(overrides + vsets)
                    lengths.add(resolve_model_config(cfg).context_length)
                    run_dir = Path(out) / "runs" / vname / preset / f"steps-{steps}" / \
                        f"seed-{seed}"
                    spec = run_spec(preset, cfg, run_dir, threads, scoring,
                                    name=f"{vname}/{preset}/{steps}/seed{seed}")
                    spec["sweep"] = {"variant": vname, "steps": steps, "seed": seed,
                                     "variant_settings": vsets}
                    specs.append(spec)
    if len(lengths) != 1:
        raise ValueError("the presets have different context lengths, so their token order "
                         "would differ; set model.context_length=N")
    return specs


def finished_runs(out: Path) -> tuple[list[dict], list[str]]:
    """(specs with results, names of unfinished runs) for every run directory under OUT."""
    done, pending = [], []
    for spec_path in sorted((out / "runs").glob(f"*/*/*/*/{SPEC_FILE}")):
        spec = json.loads(spec_path.read_text())
        result = spec_path.parent / CHILD_RESULT
        if result.is_file():
            done.append({**spec, "result": json.loads(result.read_text())})
        else:
            pending.append(spec["name"])
    return done, pending


def check_baselines(baseline: str | None, presets: list[str], out: Path) -> None:
    """Every --baseline must be a preset of this grid or of runs already in OUT: the gaps are
    computed against its runs, so a baseline that never trains gives no gaps at all."""
    if baseline is None:
        return
    given = [b.strip() for b in baseline.split(",") if b.strip()]
    known = set(presets) | {p.name for p in (out / "runs").glob("*/*") if p.is_dir()}
    unknown = [b for b in given if b not in known]
    if not given or unknown:
        raise ValueError(f"--baseline {', '.join(unknown) or repr(baseline)} is not among the "
                         f"presets of this sweep ({', '.join(sorted(known))}); name one of them "
                         "(or add it to --presets)")


def train_grid(out: Path, presets: list[str], specs: list[dict], *, data: str, jobs: int,
               baseline: str | None) -> BaseException | None:
    """Train the runs of ``specs`` not finished yet (resuming interrupted ones), rewriting the
    tables after each; returns the failure or interruption that stopped them (None if none)."""
    _remember(out, data, baseline, presets)
    todo = []
    for spec in specs:
        if plan_run(Path(spec["run_dir"]), spec, reuse=True) is None:
            todo.append(spec)
    print(f"[sweep] {len(specs)} runs in the grid, {len(specs) - len(todo)} already finished, "
          f"{len(todo)} to train", file=sys.stderr)
    if todo:
        load_corpus(data)
    _, error = train_all(todo, jobs, "sweep",
                         on_done=lambda *_: _tabulate_now(out, data=data, baseline=baseline))
    return error


def _tabulate_now(out: Path, *, data: str, baseline: str | None) -> None:
    """Rewrite the tables after every finished run, so that each one is usable at once; a
    failure here must not stop the training."""
    try:
        tabulate(out, data=data, baseline=baseline)
    except (MoeifyError, ValueError, OSError) as e:
        print(f"[sweep] tables not updated: {e}", file=sys.stderr)


def _remember(out: Path, data: str, baseline: str | None, presets: list[str]) -> None:
    """OUT/sweep.json: the corpus and the baselines, so that --tabulate needs neither."""
    path = out / SWEEP_FILE
    old = json.loads(path.read_text()) if path.is_file() else {}
    if old.get("data", data) != data:
        raise ValueError(f"{out} holds a sweep on {old['data']!r}, not {data!r}: one OUT "
                         "per corpus")
    given = [b.strip() for b in (baseline or presets[0]).split(",") if b.strip()]
    baselines = list(dict.fromkeys(old.get("baselines", []) + given))
    write_json(path, {"data": data, "baselines": baselines})


def tabulate(out: Path, *, data: str, baseline: str | None) -> dict | None:
    """Rewrite OUT/results.json, results.md and the plots from every finished run under OUT
    (None when none has finished yet). ``baseline``: comma-separated presets (default: the
    ones OUT/sweep.json remembers, else the first run's); ``data``: the corpus named in the
    tables when OUT/sweep.json does not record it."""
    done, pending = finished_runs(out)
    if not done:
        print(f"[sweep] no finished runs in {out} yet", file=sys.stderr)
        return None
    meta = json.loads((out / SWEEP_FILE).read_text()) if (out / SWEEP_FILE).is_file() else {}
    baselines = ([b.strip() for b in baseline.split(",")] if baseline
                 else meta.get("baselines") or [done[0]["preset"]])
    records = []
    for spec in done:
        r = spec["result"]
        rec = run_record(spec["preset"], spec["run_dir"], final_valid=r["final_valid"],
                         peak_memory_bytes=r.get("max_rss_bytes"),
                         peak_memory_kind="max resident set size (RSS)", blimp=r.get("blimp"))
        rec.update({k: spec["sweep"][k] for k in ("variant", "steps", "seed")})
        records.append(rec)
    return write_sweep(out, records, done, pending, baselines, meta.get("data", data))


def recipe(specs: list[dict]) -> dict:
    """The training settings every run shares (lr, batch, schedule, ...) and those that vary."""
    cfgs = [s["train_config"] for s in specs]
    keys = [k for k in cfgs[0] if k not in ("preset", "steps", "seed", "data")]
    same = {k: cfgs[0][k] for k in keys if all(c.get(k) == cfgs[0][k] for c in cfgs)}
    varies = sorted(k for k in keys if k not in same)
    return {"shared": same, "varies": varies,
            "variants": {s["sweep"]["variant"]: s["sweep"]["variant_settings"] for s in specs}}


def write_sweep(out: Path, records, specs, pending, baselines, data_name) -> dict:
    rows = sweep_table(records, baselines)
    diagnosis = routing_diagnosis(records)
    plots, errors = [], []
    for name, fn, what in (("valid_curves.png", plot_sweep, records),
                           ("gaps.png", plot_gaps, rows), ("routing.png", plot_routing, records)):
        try:
            if fn(what, out / name) is not None:
                plots.append(name)
        except MoeifyError as e:  # matplotlib missing: the numbers still get written
            errors.append(f"{name} not drawn: {e}")
    rec = recipe(specs)
    settings = {"data": data_name, "baselines": ",".join(baselines),
                **{k: rec["shared"][k] for k in ("lr", "batch_size", "warmup_steps",
                                                 "grad_clip", "betas", "weight_decay",
                                                 "tokenizer") if k in rec["shared"]},
                "varies": ",".join(rec["varies"]) or "none",
                "threads_per_run": ",".join(sorted({str(s["threads"]) for s in specs})),
                **run_settings([s["result"] for s in specs])}
    data = {"settings": settings, "recipe": rec, "table": rows, "runs": records,
            "routing": diagnosis, "pending": pending, "plots": plots, "plot_errors": errors}
    md = sweep_markdown(rows, settings, diagnosis, plots, pending)
    if errors:
        md += "\n" + "\n".join(errors) + "\n"
    write_json(out / "results.json", data)
    write_text(out / "results.md", md)
    return data
