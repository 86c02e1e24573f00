"""Train tiny sigma-MoE and Switch models on wiki-excerpt with each balancing option and write
the table of docs/balancing/README.md: final validation bpc and the per-expert load spread.

    python scripts/balancing_comparison.py --steps 60 --batch-size 8 --out runs/balancing

Each run is ``moeify train`` (in this process, through the Python API) with the settings shown
in the table; the load spread is max/mean of the per-expert load the trainer logs
(``load_spread/...`` in metrics.jsonl), averaged over the layers and over the last quarter of
the logged steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VARIANTS = {
    "tiny-sigmamoe": {
        "entropy loss (paper)": (),
        "no balancing": ("model.feedforward.entropy_coef=0",),
        "loss-free (gamma 1e-3)": ("model.feedforward.entropy_coef=0",
                                   "model.feedforward.lossfree_rate=0.001"),
    },
    "tiny-switch": {
        "per-batch balance loss (paper)": (),
        "global-batch balance loss": ("model.feedforward.balance_scope=global",),
        "loss-free (gamma 1e-3), no balance loss": ("model.feedforward.balance_coef=0",
                                                    "model.feedforward.lossfree_rate=0.001"),
    },
}


def summarise(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    train = [r for r in records if r.get("kind") == "train"]
    valid = [r for r in records if r.get("kind") == "valid"]
    tail = train[-max(1, len(train) // 4):]
    spreads = [v for r in tail for k, v in r.items() if k.startswith("load_spread/")]
    return {"bpc": valid[-1]["bpc"], "spread": sum(spreads) / len(spreads)}


def main() -> None:
    from moeify.train.config import TrainConfig
    from moeify.train.trainer import train

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--out", default="runs/balancing")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--preset", action="append", choices=list(VARIANTS),
                   help="only these models (repeatable; default both)")
    args = p.parse_args()
    rows = []
    for preset, variants in VARIANTS.items():
        if args.preset and preset not in args.preset:
            continue
        for name, sets in variants.items():
            run = Path(args.out) / f"{preset}-{len(rows)}"
            if not (run / "metrics.jsonl").is_file() or not any(
                    '"valid"' in line for line in (run / "metrics.jsonl").open()):
                cfg = TrainConfig(preset=preset, steps=args.steps, grad_accum=args.grad_accum,
                                  batch_size=args.batch_size, eval_tokens=args.eval_tokens,
                                  warmup_steps=min(20, args.steps // 4), log_every=5,
                                  eval_every=0, checkpoint_every=0, model_overrides=sets)
                train(cfg, run, quiet=True)
            rows.append((preset, name, sets, summarise(run)))
    print("| model | balancing | settings | valid bpc | load spread (max/mean) |")
    print("|---|---|---|---|---|")
    for preset, name, sets, s in rows:
        print(f"| {preset} | {name} | {' '.join(f'`{x}`' for x in sets) or '(preset)'} | "
              f"{s['bpc']:.4f} | {s['spread']:.2f} |")


if __name__ == "__main__":
    main()
