"""``moeify train``: train a preset on a corpus into a run directory (or resume one)."""

from __future__ import annotations

import argparse

from moeify.train.schedule import SCHEDULE_CHOICES


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model preset on a corpus (default: tiny-switchhead, 1M "
        "parameters, 300 steps on wiki-excerpt)",
        description="Train a model preset on a corpus and print the final validation bpc (or "
        "perplexity). With no arguments: the small SwitchHead preset (tiny-switchhead) on the "
        "wiki-excerpt corpus at byte level. The run directory holds the resolved configs, the "
        "tokenizer, metrics.jsonl and atomic checkpoints; --resume continues it exactly. "
        "--init-from starts a new run from another run's weights.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  moeify train\n"
               "  moeify train --preset tiny-dense --steps 500 --out runs/dense\n"
               "  moeify train --data shakespeare --set tokenizer=byte256 --set lr=1e-3\n"
               "  moeify train --set model.d_model=64 --set model.n_layers=2\n"
               "  moeify train --resume runs/tiny-switchhead-wiki-excerpt --steps 600 "
               "--schedule stretch\n"
               "  moeify train --init-from runs/tiny-switchhead-wiki-excerpt --data shakespeare "
               "--set lr=1e-3\n"
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
    p.add_argument("--schedule", choices=SCHEDULE_CHOICES,
                   help="with --resume and a new --steps, what the learning-rate schedule does "
                   "after the decay has begun: keep (the run's own schedule; past its end, "
                   "its final rate), extend (the decay continues from the current rate down to "
                   "the floor at the new last step), stretch (warm-up and cosine recomputed "
                   "over the new steps; the rate jumps to that curve). Without it such a "
                   "resume is refused, saying what each would do")
    p.add_argument("--init-from", metavar="RUN",
                   help="start a new run from the weights (and tokenizer) of RUN or one of "
                   "its checkpoints, with RUN's training settings and a fresh optimizer and "
                   "schedule; change data, steps or --set lr=... freely")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--list-settings", action="store_true",
                   help="print every --set key (training settings, then the model.* fields of "
                   "--preset) with its default, accepted values and meaning, and exit")
    p.set_defaults(func=run)


def run(args) -> int:
    from moeify.train.distributed import device_type, process_group
    from moeify.train.trainer import train

    if args.list_settings:
        return _list_settings(args)
    _check_flags(args)
    explicit = {k: v for k, v in (("preset", args.preset), ("data", args.data),
                                  ("steps", args.steps)) if v is not None}
    if args.init_from is not None:
        return _init_from(args, explicit)
    resume = args.resume
    run_dir = _resume_dir(args) if resume is not None else None
    cfg = _run_config(args, explicit, run_dir)
    if run_dir is None:
        run_dir = _new_run_dir(args, cfg)
    _configure_threads(cfg)
    with process_group(device_type(cfg.device)):  # one per process (train.distributed)
        result = train(cfg, run_dir, resume=resume if resume is not None else False,
                       quiet=args.quiet, schedule=args.schedule)
    return _report(result)


def _list_settings(args) -> int:
    from moeify.train.config import TrainConfig
    from moeify.train.settings import settings_rows

    rows = settings_rows(args.preset or TrainConfig().preset)
    w = max(len(r[0]) for r in rows)
    for key, default, kind, text in rows:
        print(f"{key:<{w}}  {default:<15} {kind:<22} {text}".rstrip())
    return 0


def _check_flags(args) -> None:
    """Flags that do not go together, refused before anything is read."""
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be a positive integer, got {args.steps}")
    if args.schedule is not None and args.resume is None:
        raise ValueError("--schedule goes with --resume RUN --steps N (what the learning-rate "
                         "schedule does when a resumed run's length changes)")
    if args.init_from is not None and (args.resume is not None or args.preset is not None):
        raise ValueError("--init-from starts a new run with the model of RUN: it does not go "
                         "with --resume or --preset")


def _resume_dir(args):
    """The run directory --resume continues (``--resume`` alone: the one in --out)."""
    from pathlib import Path

    from moeify.errors import MoeifyError
    from moeify.rundir.layout import resolve_checkpoint, run_dir_of

    if args.resume is True:
        if args.out is None:
            raise MoeifyError("--resume without a directory continues the run in --out: "
                              "give --resume runs/NAME (or --out runs/NAME --resume)")
        return Path(args.out)
    run_dir = run_dir_of(resolve_checkpoint(args.resume))
    if args.out is not None and Path(args.out).resolve() != run_dir.resolve():
        raise MoeifyError(f"--resume {args.resume} belongs to run {run_dir}, but --out is "
                          f"{args.out}; drop --out")
    return run_dir


def _run_config(args, explicit: dict, run_dir):
    """The settings of the run: a resumed run's own (``run_dir``) or the defaults, with the
    flags and --set applied, checked, and the data identified."""
    import dataclasses

    from moeify.train.config import TrainConfig, read_train_config, resolve_model_config

    base = read_train_config(run_dir) if run_dir is not None else TrainConfig()
    cfg = dataclasses.replace(base, **explicit).with_overrides(args.overrides)
    if run_dir is not None and _weights_only(run_dir if args.resume is True else args.resume):
        # An imported model (weights, nothing trained yet): fine-tuning settings, not the
        # tiny presets' from-scratch ones.
        cfg = apply_finetune_defaults(cfg, args, source_dtype=_imported_dtype(run_dir),
                                      context=resolve_model_config(cfg, run_dir=run_dir
                                                                   ).context_length)
    # Unknown presets and bad model overrides fail before any data work.
    resolve_model_config(cfg, run_dir=run_dir)
    return with_data_identity(cfg, run_dir if args.data is None else None, quiet=args.quiet)


def _new_run_dir(args, cfg):
    import os
    from pathlib import Path

    from moeify.rundir.layout import default_run_dir

    if args.out is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Each process would pick its own numbered default directory.
        raise ValueError("with torchrun, name the run directory: --out runs/NAME")
    return Path(args.out) if args.out else default_run_dir(Path("runs"), cfg.preset, cfg.data)


def _configure_threads(cfg) -> None:
    if not cfg.device.startswith("cuda"):
        from moeify.train.distributed import configure_cpu_threads

        configure_cpu_threads()


def _init_from(args, explicit: dict) -> int:
    import dataclasses
    from pathlib import Path

    from moeify.rundir.layout import default_run_dir, resolve_checkpoint, run_dir_of
    from moeify.train.start import init_config, train_from

    source_run = None if args.data else run_dir_of(resolve_checkpoint(args.init_from))
    cfg = with_data_identity(dataclasses.replace(init_config(args.init_from), **explicit
                                                 ).with_overrides(args.overrides), source_run,
                             quiet=args.quiet)
    cfg = apply_finetune_defaults(cfg, args, context=cfg.model["context_length"])
    run_dir = Path(args.out) if args.out else default_run_dir(Path("runs"), cfg.preset, cfg.data)
    _configure_threads(cfg)
    return _report(train_from(cfg, run_dir, args.init_from, quiet=args.quiet))


def _weights_only(target) -> bool:
    from moeify.rundir.checkpoints import read_meta
    from moeify.rundir.layout import resolve_checkpoint

    return bool(read_meta(resolve_checkpoint(target)).get("weights_only"))


def _imported_dtype(run_dir) -> str | None:
    """The dtype an imported checkpoint was stored in (its config.json's torch_dtype)."""
    import json

    from moeify.interop.hf_import import HF_CONFIG_COPY

    try:
        hf = json.loads((run_dir / HF_CONFIG_COPY).read_text())
    except (OSError, ValueError):
        return None
    dtype = hf.get("torch_dtype") or hf.get("dtype") if isinstance(hf, dict) else None
    return dtype if isinstance(dtype, str) else None


def apply_finetune_defaults(cfg, args, *, source_dtype: str | None = None,
                            context: int | None = None):
    """``cfg`` with moeify.train.finetune's defaults for every setting ``args.overrides`` does
    not give, the line saying so printed (process 0, unless --quiet)."""
    import os
    import sys

    import torch

    from moeify.train.finetune import finetune_defaults
    from moeify.train.values import split_override

    explicit = {split_override(o)[0] for o in args.overrides}
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    cfg, line = finetune_defaults(cfg, explicit=explicit, source_dtype=source_dtype, cuda=cuda,
                                  context=context)
    if not getattr(args, "quiet", False) and os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)
    return cfg


def with_data_identity(cfg, recorded_in=None, *, quiet: bool = False):
    """``cfg`` with its data recorded as what identifies it (moeify.rundir.data): a local path
    made absolute, with its content's fingerprint, so the run works from any directory.
    ``recorded_in``: the run directory whose config.json gave ``cfg.data`` (a resume without
    --data), where a relative path recorded as typed is looked up."""
    import dataclasses
    from pathlib import Path

    from moeify.errors import MoeifyError
    from moeify.rundir.data import identify, is_corpus_name, recorded_spec

    spec = cfg.data
    if recorded_in is not None and not is_corpus_name(spec):
        spec = recorded_spec(cfg.data, recorded_in)
        if not Path(spec).expanduser().exists():
            raise MoeifyError(f"{recorded_in} was trained on {cfg.data}, which is not there (from "
                              "here or the run's directory): give --data PATH with the same text")
    from moeify.data.cache import quiet_progress

    with quiet_progress(quiet):
        data, sha = identify(spec)
    return dataclasses.replace(cfg, data=data, data_sha256=sha)


def _report(result) -> int:
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
