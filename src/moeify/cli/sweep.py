"""``moeify sweep``: the arguments (presets, budgets, seeds, variants). The grid's runs, their
training and the tables are moeify.sweep.grid's (``--tabulate`` only rewrites the tables)."""

from __future__ import annotations

import os
from pathlib import Path

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


# moeify.sweep is imported inside the functions, as every cli module imports its work: `moeify`
# imports every subcommand's module to build its parser, and torch must not load before the
# command runs (moeify bench sets OpenMP's wait policy first).
def run(args) -> int:
    from moeify.sweep.grid import check_baselines, tabulate, train_grid
    from moeify.sweep.scheduler import lock_out, refuse_other_study

    out = Path(args.out)
    refuse_other_study(out, "sweep")
    error = None
    if not args.tabulate:
        presets, specs = _grid(args)
        lock = lock_out(out, "sweep")
        try:
            error = train_grid(out, presets, specs, data=args.data, jobs=args.jobs,
                               baseline=args.baseline)
            data = tabulate(out, data=args.data, baseline=args.baseline)
        finally:
            lock.release()
        return _report(out, data, error)
    elif not (out / "runs").is_dir():
        raise ValueError(f"{out} holds no sweep runs (no {out / 'runs'}): run the sweep first")
    check_baselines(args.baseline, [], out)
    return _report(out, tabulate(out, data=args.data, baseline=args.baseline), None)


def _report(out: Path, data: dict | None, error: BaseException | None) -> int:
    if data is not None:
        from moeify.analysis.sweep import main_table
        from moeify.sweep.scheduler import report_written

        print(main_table((out / "results.md").read_text()))
        report_written(out, data)
    if error is not None:
        raise error
    return 0 if data is not None else 1


def _grid(args) -> tuple[list[str], list[dict]]:
    """The presets and the run specs of the grid the arguments ask for (checked)."""
    from moeify.sweep.grid import check_baselines, grid_specs
    from moeify.sweep.protocol import Scoring

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
    scoring = Scoring(final_eval_tokens=args.final_eval_tokens,
                      blimp_per_paradigm=args.blimp_per_paradigm, blimp_data=args.blimp_data)
    return presets, grid_specs(Path(args.out), presets, budgets, seeds, variants, threads,
                               data=args.data, overrides=args.overrides, scoring=scoring)


