"""``moeify upcycle``: turn a trained dense run into a Mixture-of-Experts run that continues
training from its weights (moeify.models.upcycle)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "upcycle", help="convert a trained dense run into an MoE run (SwitchHead, MoA, sigma-MoE, "
        "Switch, Mixture-of-Depths) that `train --resume` continues",
        description="Convert the latest checkpoint of a dense run into a Mixture-of-Experts "
        "model and write it as a new run directory: the resolved configs, the source's "
        "tokenizer, and a step-0 checkpoint with a fresh optimizer. `moeify train --resume OUT` "
        "trains it for --steps; count, eval and generate accept it. The source run is only read.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="conversions (options key=value, comma-separated; defaults in brackets):\n"
               "  --attention switchhead:E=,k=[E],experts=[vo],router_scale=[0.1],seed=[0]\n"
               "  --attention moa:k=,kv_head=[0],router_scale=[0.1]\n"
               "  --attention moh:shared=,k=,router=[learned]|query_norm,router_scale=[0.1],"
               "balance_coef=[0.01]\n"
               "  --ff sigma-moe:E=,k=[E],split=[cluster]|contiguous,router=[keys]|random,"
               "router_scale=[0.1],entropy_coef=[1e-4]\n"
               "  --ff switch:E=,k=[1],noise=[0],reinit=[0],router_scale=[0.01],"
               "dropless=[true],capacity_factor=[1.25]\n"
               "  --depth mod:blocks=[1,3,...],capacity=[0.125],router_scale=[0.1]\n"
               "exact (same logits as the dense model): sigma-moe with k=E,router_scale=0; switch "
               "with router_scale=0; mod with capacity=1,router_scale=0; moh with k=heads-shared,"
               "router_scale=0\n"
               "imported checkpoints (moeify import): two-layer MLPs (GPT-2's GELU) convert to "
               "sigma-moe / switch, multi-head attention to switchhead (its biases dropped) or moh "
               "(kept); grouped-query attention to moh; gated (SwiGLU) MLPs stay dense\n"
               "examples:\n"
               "  moeify upcycle --run runs/dense --out runs/sh --attention switchhead:E=4,k=2\n"
               "  moeify upcycle --run runs/dense --out runs/all --attention switchhead:E=4,k=2 "
               "--ff sigma-moe:E=8,k=2\n"
               "  moeify train --resume runs/all")
    p.add_argument("--run", required=True, help="the dense source run (or one of its "
                   "checkpoints)")
    p.add_argument("--out", required=True, help="the new run directory (must not exist yet, "
                   "or be empty)")
    p.add_argument("--attention", help="attention conversion (switchhead:..., moa:..., moh:...)")
    p.add_argument("--ff", help="feedforward conversion (sigma-moe:..., switch:...)")
    p.add_argument("--depth", help="depth conversion (mod:...)")
    p.add_argument("--steps", type=int, help="the new run's total steps (default: the source "
                   "run's)")
    p.add_argument("--data", help="corpus of the new run (default: the source run's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a training setting of the new run (lr=1e-3, ...); repeatable")
    p.add_argument("--no-validate", action="store_true",
                   help="skip measuring the validation loss right after the conversion")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    from pathlib import Path

    from moeify.models.cost import model_cost
    from moeify.models.upcycle import is_exact, upcycle
    from moeify.rundir import load_trained
    from moeify.rundir.layout import resolve_checkpoint, run_dir_of
    from moeify.train.distributed import configure_cpu_threads

    _check_flags(args)
    src_dir = run_dir_of(resolve_checkpoint(args.run))
    out = Path(args.out)
    _check_out(out, src_dir)
    configure_cpu_threads()
    src = load_trained(args.run, "cpu")
    model = upcycle(src.model, attention=args.attention, feedforward=args.ff, depth=args.depth)
    cfg = _new_run_config(args, src, src_dir, model)
    valid = _write_run(args, cfg, out, model, src.tokenizer)
    summary = _summary(args, src, model, valid, out, is_exact(args.attention, args.ff,
                                                               args.depth,
                                                               source=src.model_config),
                       model_cost)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary, src, src_dir, out, valid)
    return 0


def _check_flags(args) -> None:
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be a positive integer, got {args.steps}")
    for flag, key in (("--steps", "steps"), ("--data", "data")):
        given = [o for o in args.overrides if o.split("=", 1)[0].strip() == key]
        if getattr(args, key) is not None and given:
            raise ValueError(f"{flag} {getattr(args, key)} and --set {given[-1]} both set the "
                             f"new run's {key}; give one of them")
    if args.attention is None and args.ff is None and args.depth is None:
        raise ValueError("name at least one conversion: --attention, --ff or --depth")


def _check_out(out, src_dir) -> None:
    """--out must be a new (or empty) directory, not the source run."""
    from moeify.data.cache import sweep_stale_directories
    from moeify.errors import MoeifyError

    if out.resolve() == src_dir.resolve():
        raise MoeifyError("--out is the source run; the source is never modified, choose a new "
                          "directory")
    sweep_stale_directories(out)  # what a killed upcycle into --out left beside it
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoeifyError(f"--out {out} already exists and is not empty; choose a new directory")


def _new_run_config(args, src, src_dir, model):
    """The new run's settings: the source run's, with the upcycled model, the flags, --set and
    the fine-tuning defaults."""
    import dataclasses

    from moeify.cli.train import apply_finetune_defaults, with_data_identity
    from moeify.errors import MoeifyError
    from moeify.train.config import TrainConfig, read_train_config

    if src.train_config is None and args.data is None:
        raise MoeifyError(f"{src_dir} has no training configuration; give --data for the new "
                          "run's corpus")
    base = read_train_config(src_dir) if src.train_config is not None else TrainConfig()
    explicit = {k: v for k, v in (("steps", args.steps), ("data", args.data)) if v is not None}
    cfg = dataclasses.replace(base, preset="upcycled", model_overrides=(),
                              model=model.config.to_dict(), **explicit
                              ).with_overrides(args.overrides)
    cfg = with_data_identity(cfg, None if args.data else src_dir)
    return apply_finetune_defaults(cfg, args, context=model.config.context_length)


def _write_run(args, cfg, out, model, tokenizer):
    """The new run directory with its step-0 checkpoint; the validation at step 0 (or None)."""
    from moeify.data.cache import atomic_directory
    from moeify.errors import MoeifyError
    from moeify.train.start import start_run_from_model

    # Written beside --out and renamed at the end: a failure (a full disk) or a kill leaves no
    # half-made run directory; a killed attempt's temporary directory is swept by the next.
    with atomic_directory(out, "upcycle") as tmp:
        try:
            return start_run_from_model(cfg, tmp, model, tokenizer,
                                        validate=not args.no_validate)
        except MoeifyError as e:  # the trainer's message names the temporary directory
            raise MoeifyError(str(e).replace(str(tmp), str(out))) from None


def _print_summary(summary: dict, src, src_dir, out, valid) -> None:
    print(f"upcycled {src_dir} (step {src.checkpoint.step}) -> {out} (step 0)")
    for name in ("attention", "feedforward", "depth"):
        if summary["conversions"][name]:
            print(f"  {name}: {summary['conversions'][name]}")
    print(f"  function at conversion: {'exact' if summary['exact'] else 'approximate'}")
    print(f"  parameters {summary['params_dense']:,} -> {summary['params']:,}")
    if valid is not None:
        name = "bpc" if "bpc" in valid else "ppl"
        dense = summary.get("dense_valid")
        was = f"dense {dense[name]:.4f} at step {dense['step']}, " if dense else ""
        print(f"  validation {name}: {was}upcycled {valid[name]:.4f}")
    print(f"continue with: moeify train --resume {out}")


def _summary(args, src, model, valid, out, exact, model_cost) -> dict:
    from moeify.train.metrics import read_metrics

    dense = [r for r in read_metrics(src.run_dir)
             if r.get("kind") == "valid" and r.get("step") == src.checkpoint.step]
    return {"source": str(src.run_dir), "source_step": src.checkpoint.step, "out": str(out),
            "conversions": {"attention": args.attention, "feedforward": args.ff,
                            "depth": args.depth},
            "exact": exact, "params_dense": model_cost(src.model_config).params,
            "params": model_cost(model.config).params, "valid": valid,
            "dense_valid": dense[-1] if dense else None}
