"""``moeify sweep``: a grid of presets x training budgets x seeds (x named setting variants),
trained one run per child process as ``moeify compare`` does (the same scheduler, child and
run-directory rules), then tabulated by moeify.analysis.sweep.

Runs live in OUT/runs/VARIANT/PRESET/steps-N/seed-S. A run is finished when its directory holds
the child's result with the same settings; a finished run is never trained again, an interrupted
one resumes from its last checkpoint, so a killed sweep continues where it stopped. The table
covers every finished run under OUT/runs (several invocations may fill one OUT, e.g. more seeds
or presets later); ``--tabulate`` only rewrites it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from moeify.cli.compare import (CHILD_RESULT, SPEC_FILE, _spec, _write_json, lock_out,
                                plan_run, report_written, run_settings, train_all)

SWEEP_FILE = "sweep.json"
BASE = "base"


def register(sub) -> None:
    p = sub.add_parser(
        "sweep", help="train a grid of presets x budgets x seeds (resumable) and tabulate "
        "mean ± standard error and the gap to a baseline",
        description="Train every preset for every budget and seed (and every --variant), one "
        "run at a time per job, resumable: finished runs in OUT are kept, interrupted ones "
        "resume. Writes OUT/results.json, OUT/results.md (mean ± standard error over seeds, "
        "the gap to the baseline paired by seed), OUT/valid_curves.png (validation score "
        "against training tokens and time), OUT/gaps.png (the gaps against the budget) and, for "
        "SwitchHead runs, OUT/routing.png.")
    p.add_argument("--presets", help="comma-separated preset names (`moeify presets`)")
    p.add_argument("--budgets", default="300", help="comma-separated training steps "
                   "(default 300)")
    p.add_argument("--seeds", default="0", help="seeds: a comma list and/or ranges, e.g. "
                   "0,1,2 or 0-4 (default 0)")
    p.add_argument("--variant", dest="variants", action="append", default=[],
                   metavar="NAME:KEY=VALUE", help="a named variant with one more training "
                   "setting (repeat a NAME to give it several); the grid always has the "
                   f"'{BASE}' variant (only the common --set settings)")
    p.add_argument("--baseline", help="comma-separated baseline presets: each preset is "
                   "compared with the first baseline of its family (the name before the first "
                   "'-'), else the first one (default: the first preset)")
    p.add_argument("--data", default="wiki-excerpt", help="corpus (default wiki-excerpt)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="training setting for every run; repeatable")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at the same time "
                   "(default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run "
                   "(default: CPU cores / jobs)")
    p.add_argument("--final-eval-tokens", type=int, default=0, help="validation tokens scored "
                   "after training (default 0: the whole split)")
    p.add_argument("--blimp-per-paradigm", type=int, default=0, help="BLiMP pairs per "
                   "paradigm (default 0: skipped, since a sweep trains many runs; moeify compare "
                   "defaults to 20)")
    p.add_argument("--blimp-data", help="BLiMP directory (default $MOEIFY_DATA_DIR/blimp)")
    p.add_argument("--tabulate", action="store_true", help="train nothing: rewrite the tables "
                   "and plots from the finished runs in OUT")
    p.set_defaults(func=run)


def parse_ints(text: str, what: str) -> list[int]:
    out: list[int] = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ValueError(f"{what} expects integers or ranges such as 0-2, got {text!r}")
    if not out or len(set(out)) != len(out):
        raise ValueError(f"{what} needs distinct values, got {text!r}")
    return out


def parse_variants(items: list[str]) -> dict[str, list[str]]:
    variants: dict[str, list[str]] = {BASE: []}
    for item in items:
        name, sep, setting = item.partition(":")
        if not sep or not name or "=" not in setting or "/" in name:
            raise ValueError(f"--variant expects NAME:KEY=VALUE (e.g. lr3e-3:lr=3e-3), got "
                             f"{item!r}")
        if name == BASE:
            raise ValueError(f"the variant name {BASE!r} is the grid's own; choose another")
        variants.setdefault(name, []).append(setting)
    return variants


def grid_specs(args, presets, budgets, seeds, variants, threads) -> list[dict]:
    """One spec per run, ordered budget, seed, variant, preset: the cheapest complete
    comparisons first, and a seed's presets side by side."""
    from moeify.train.config import TrainConfig, resolve_model_config

    specs, lengths = [], set()
    for steps in budgets:
        for seed in seeds:
            for vname, vsets in variants.items():
                for preset in presets:
                    cfg = TrainConfig(preset=preset, data=args.data, steps=steps,
                                      seed=seed).with_overrides(args.overrides + vsets)
                    lengths.add(resolve_model_config(cfg).context_length)
                    run_dir = Path(args.out) / "runs" / vname / preset / f"steps-{steps}" / \
                        f"seed-{seed}"
                    spec = _spec(preset, cfg, run_dir, threads, args,
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


def run(args) -> int:
    out = Path(args.out)
    error = None
    if not args.tabulate:
        presets, specs = _grid(args)
        lock = lock_out(out, "sweep")
        try:
            error = _train(args, out, presets, specs)
            data = tabulate(out, args)
        finally:
            lock.release()
        return _report(out, data, error)
    elif not (out / "runs").is_dir():
        raise ValueError(f"{out} holds no sweep runs (no {out / 'runs'}): run the sweep first")
    check_baselines(args.baseline, [], out)
    return _report(out, tabulate(out, args), None)


def _report(out: Path, data: dict | None, error: BaseException | None) -> int:
    if data is not None:
        from moeify.analysis.sweep import main_table

        print(main_table((out / "results.md").read_text()))
        report_written(out, data)
    if error is not None:
        raise error
    return 0 if data is not None else 1


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


def _grid(args) -> tuple[list[str], list[dict]]:
    """The presets and the run specs of the grid the arguments ask for (checked)."""
    if not args.presets:
        raise ValueError("--presets is required unless --tabulate")
    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    if not presets:
        raise ValueError(f"--presets needs at least one preset name, got {args.presets!r}")
    if len(set(presets)) != len(presets):
        raise ValueError(f"--presets needs distinct preset names, got {args.presets!r}")
    check_baselines(args.baseline, presets, Path(args.out))
    budgets = parse_ints(args.budgets, "--budgets")
    seeds = parse_ints(args.seeds, "--seeds")
    if min(budgets) < 1 or args.jobs < 1 or (args.threads is not None and args.threads < 1):
        raise ValueError("--budgets, --jobs and --threads must be positive integers")
    variants = parse_variants(args.variants)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    return presets, grid_specs(args, presets, budgets, seeds, variants, threads)


def _train(args, out: Path, presets: list[str], specs: list[dict]) -> BaseException | None:
    from moeify.data import load_corpus

    _remember(out, args, presets)
    todo = []
    for spec in specs:
        if plan_run(Path(spec["run_dir"]), spec, reuse=True) is None:
            todo.append(spec)
    print(f"[sweep] {len(specs)} runs in the grid, {len(specs) - len(todo)} already finished, "
          f"{len(todo)} to train", file=sys.stderr)
    if todo:
        load_corpus(args.data)
    _, error = train_all(todo, args.jobs, "sweep", on_done=lambda *_: _tabulate_now(out, args))
    return error


def _tabulate_now(out: Path, args) -> None:
    """Rewrite the tables after every finished run, so that each one is usable at once; a
    failure here must not stop the training."""
    from moeify.errors import MoeifyError

    try:
        tabulate(out, args)
    except (MoeifyError, ValueError, OSError) as e:
        print(f"[sweep] tables not updated: {e}", file=sys.stderr)


def _remember(out: Path, args, presets: list[str]) -> None:
    """OUT/sweep.json: the corpus and the baselines, so that --tabulate needs neither."""
    path = out / SWEEP_FILE
    old = json.loads(path.read_text()) if path.is_file() else {}
    if old.get("data", args.data) != args.data:
        raise ValueError(f"{out} holds a sweep on {old['data']!r}, not {args.data!r}: one OUT "
                         "per corpus")
    given = [b.strip() for b in (args.baseline or presets[0]).split(",") if b.strip()]
    baselines = list(dict.fromkeys(old.get("baselines", []) + given))
    _write_json(path, {"data": args.data, "baselines": baselines})


def tabulate(out: Path, args) -> dict | None:
    from moeify.analysis.compare import run_record

    done, pending = finished_runs(out)
    if not done:
        print(f"[sweep] no finished runs in {out} yet", file=sys.stderr)
        return None
    meta = json.loads((out / SWEEP_FILE).read_text()) if (out / SWEEP_FILE).is_file() else {}
    baselines = ([b.strip() for b in args.baseline.split(",")] if args.baseline
                 else meta.get("baselines") or [done[0]["preset"]])
    records = []
    for spec in done:
        r = spec["result"]
        rec = run_record(spec["preset"], spec["run_dir"], final_valid=r["final_valid"],
                         peak_memory_bytes=r.get("max_rss_bytes"),
                         peak_memory_kind="max resident set size (RSS)", blimp=r.get("blimp"))
        rec.update({k: spec["sweep"][k] for k in ("variant", "steps", "seed")})
        records.append(rec)
    return write_sweep(out, records, done, pending, baselines, meta.get("data", args.data))


def recipe(specs: list[dict]) -> dict:
    """The training settings every run shares (lr, batch, schedule, ...) and those that vary."""
    cfgs = [s["train_config"] for s in specs]
    keys = [k for k in cfgs[0] if k not in ("preset", "steps", "seed", "data")]
    same = {k: cfgs[0][k] for k in keys if all(c.get(k) == cfgs[0][k] for c in cfgs)}
    varies = sorted(k for k in keys if k not in same)
    return {"shared": same, "varies": varies,
            "variants": {s["sweep"]["variant"]: s["sweep"]["variant_settings"] for s in specs}}


def write_sweep(out: Path, records, specs, pending, baselines, data_name) -> dict:
    from moeify.analysis.sweep import (plot_gaps, plot_routing, plot_sweep, routing_diagnosis,
                                       sweep_markdown, sweep_table, write_json, write_text)
    from moeify.errors import MoeifyError

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
