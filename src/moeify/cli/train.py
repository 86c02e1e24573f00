"""``moeify train``: train a preset on a corpus into a run directory (or resume one)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model preset on a corpus (default: tiny-switchhead on "
        "wiki-excerpt, about 5 minutes on 2 CPU cores)",
        description="Train a model preset on a corpus and print the final validation bpc (or "
        "perplexity). With no arguments: the small SwitchHead preset (tiny-switchhead) on the "
        "wiki-excerpt corpus at byte level. The run directory holds the resolved configs, the "
        "tokenizer, metrics.jsonl and atomic checkpoints; --resume continues it exactly.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  moeify train\n"
               "  moeify train --preset tiny-dense --steps 500 --out runs/dense\n"
               "  moeify train --data shakespeare --set tokenizer=byte256 --set lr=1e-3\n"
               "  moeify train --set model.d_model=64 --set model.n_layers=2\n"
               "  moeify train --resume runs/tiny-switchhead-wiki-excerpt --steps 600\n"
               "  torchrun --nproc-per-node 2 -m moeify.cli.main train --out runs/ddp\n"
               "settings (--set key=value): see `moeify train --list-settings`")
    p.add_argument("--preset", help="model preset (`moeify presets`; default tiny-switchhead)")
    p.add_argument("--data", help="corpus name (wiki-excerpt, shakespeare, enwik8, text8, "
                   "wikitext-103) or a local text file / directory (default wiki-excerpt)")
    p.add_argument("--steps", type=int, help="optimizer steps (default 300)")
    p.add_argument("--out", help="run directory (default runs/<preset>-<corpus>, numbered when "
                   "it exists)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a training setting (lr=1e-3, batch_size=32, amp=bf16, ...) or "
                   "a model field (model.d_model=64, model.attention.n_experts=8); repeatable")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="DIR",
                   help="continue a run from its latest checkpoint (DIR: the run directory or "
                   "one of its checkpoints; without DIR, the run in --out)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--list-settings", action="store_true",
                   help="print the training settings with their defaults and exit")
    p.set_defaults(func=run)


# Over 60 lines: the command's steps in order (argument checks, config, trainer, report).
def run(args) -> int:
    import dataclasses
    import os
    from pathlib import Path

    from moeify.errors import MoeifyError
    from moeify.train.config import TrainConfig, resolve_model_config
    from moeify.train.rundir import default_run_dir, read_train_config
    from moeify.train.trainer import train

    if args.list_settings:
        for f in dataclasses.fields(TrainConfig):
            print(f"{f.name:<18} {getattr(TrainConfig(), f.name)!r}")
        return 0
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be a positive integer, got {args.steps}")
    explicit = {k: v for k, v in (("preset", args.preset), ("data", args.data),
                                  ("steps", args.steps)) if v is not None}
    resume = args.resume
    if resume is not None:
        if resume is True:
            if args.out is None:
                raise MoeifyError("--resume without a directory continues the run in --out: "
                                  "give --resume runs/NAME (or --out runs/NAME --resume)")
            run_dir = Path(args.out)
        else:
            from moeify.train.checkpoint import resolve_checkpoint, run_dir_of

            run_dir = run_dir_of(resolve_checkpoint(resume))
            if args.out is not None and Path(args.out).resolve() != run_dir.resolve():
                raise MoeifyError(f"--resume {resume} belongs to run {run_dir}, but --out is "
                                  f"{args.out}; drop --out")
        base = read_train_config(run_dir)
    else:
        base = TrainConfig()
    cfg = dataclasses.replace(base, **explicit).with_overrides(args.overrides)
    # Unknown presets and bad model overrides fail before any data work.
    resolve_model_config(cfg, run_dir=run_dir if resume is not None else None)
    if resume is None:
        if args.out is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Each process would pick its own numbered default directory.
            raise ValueError("with torchrun, name the run directory: --out runs/NAME")
        run_dir = Path(args.out) if args.out else default_run_dir(Path("runs"), cfg.preset,
                                                                  cfg.data)
    if not cfg.device.startswith("cuda"):
        from moeify.train.distributed import configure_cpu_threads

        configure_cpu_threads()
    result = train(cfg, run_dir, resume=resume if resume is not None else False,
                   quiet=args.quiet)
    from moeify.train.progress import format_duration, format_rate

    if result.interrupted:
        return result.exit_code
    if result.rank != 0:
        return 0
    v = result.valid
    if v is not None:
        name = "bpc" if "bpc" in v else "ppl"
        print(f"final validation {name} {v[name]:.4f} (loss {v['loss']:.4f} over {v['tokens']} "
              f"tokens) at step {result.step}")
    print(f"run directory {result.run_dir}; wall time {format_duration(result.wall_s)}; "
          f"{format_rate(result.tokens_per_s)} tokens/s")
    return 0
