"""``moeify compare``: the arguments. Training every preset in its own child process and
writing OUT/results.json, OUT/results.md and OUT/curves.png is moeify.sweep.compare's (the
scheduler and the child: moeify.sweep.scheduler, moeify.sweep.child)."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "compare", help="train several presets identically and tabulate their quality and cost",
        description="Train each preset on the same corpus for the same number of steps (same "
        "seed, same token order), then write OUT/results.json and OUT/results.md (parameters, "
        "attention MACs and memory, final validation bpc or perplexity, training tokens/s, peak "
        "memory, BLiMP accuracy) and OUT/curves.png. Runs live in OUT/runs/PRESET.")
    p.add_argument("--presets", required=True, help="comma-separated preset names "
                   "(`moeify presets`; the CPU-scale family is repro-dense, repro-dense-h2, "
                   "repro-switchhead, repro-moa, repro-switchall)")
    p.add_argument("--data", default="wiki-excerpt", help="corpus (default wiki-excerpt)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed shared by every run (default 0)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="training setting for every run (batch_size=16, eval_every=50, ...); "
                   "repeatable")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at the same time "
                   "(default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default: "
                   "CPU cores / jobs). Oversubscribed OpenMP threads on a busy machine slow "
                   "training many times over")
    p.add_argument("--final-eval-tokens", type=int, default=0, help="validation tokens scored "
                   "after training (default 0: the whole split)")
    p.add_argument("--blimp-per-paradigm", type=int, default=20, help="BLiMP pairs per paradigm "
                   "(default 20; 0 skips BLiMP; moeify sweep, with many more runs, defaults to 0)")
    p.add_argument("--blimp-data", help="BLiMP directory (default $MOEIFY_DATA_DIR/blimp)")
    p.add_argument("--last-k", type=int, default=3, help="validation points the ordering is "
                   "checked over (default 3)")
    p.add_argument("--reuse", action="store_true", help="keep runs that already finished in "
                   "OUT/runs with the same settings instead of refusing to overwrite them")
    p.set_defaults(func=run)


def _check(args) -> list[str]:
    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    if not presets:
        raise ValueError(f"--presets needs at least one preset name, got {args.presets!r}")
    if len(set(presets)) != len(presets):
        raise ValueError(f"--presets needs distinct preset names, got {args.presets!r}")
    for name, v in (("--steps", args.steps), ("--jobs", args.jobs)):
        if v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be a positive integer, got {args.threads}")
    if args.final_eval_tokens < 0 or args.blimp_per_paradigm < 0 or args.last_k < 1:
        raise ValueError("--final-eval-tokens and --blimp-per-paradigm must be >= 0, "
                         "--last-k >= 1")
    return presets


def run(args) -> int:
    from moeify.sweep.compare import compare
    from moeify.sweep.protocol import Scoring

    presets = _check(args)
    scoring = Scoring(final_eval_tokens=args.final_eval_tokens,
                      blimp_per_paradigm=args.blimp_per_paradigm, blimp_data=args.blimp_data)
    return compare(presets, Path(args.out), data=args.data, steps=args.steps, seed=args.seed,
                   overrides=args.overrides, jobs=args.jobs, threads=args.threads,
                   scoring=scoring, last_k=args.last_k, reuse=args.reuse)
