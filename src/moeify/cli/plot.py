"""``moeify plot {attention,experts,curves}``: pictures of trained runs (needs moeify[plot])."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("plot", help="attention maps, expert usage and training curves of runs",
                       description="Draw PNG plots of trained runs (run directories written by "
                       "`moeify train`). Needs matplotlib: pip install -e '.[plot]' in the moeify checkout.")
    kinds = p.add_subparsers(dest="plot_kind", metavar="KIND", required=True)

    a = kinds.add_parser("attention", help="per-head attention maps of one text, with "
                         "SwitchHead's expert selections and per-head entropy",
                         description="Per head, the attention map of TEXT at one layer (the "
                         "SwitchHead paper's Figure 2 style: destination-side O expert gates as "
                         "a strip beside the rows, source-side V expert gates under the "
                         "columns), plus the max over heads. Dense and MoA models get the maps "
                         "alone. Per-head attention entropy is printed and drawn in the titles.")
    a.add_argument("--run", required=True, help="run directory (its latest checkpoint is used)")
    a.add_argument("--text", required=True, help="the text to feed (cut to the context length)")
    a.add_argument("--layer", type=int, default=0, help="attention layer, 0-based (default 0; "
                   "negative counts from the end)")
    a.add_argument("--out", required=True, help="output PNG path")
    a.add_argument("--json", action="store_true", help="print the entropies as JSON")
    a.set_defaults(func=run_attention)

    e = kinds.add_parser("experts", help="expert usage per layer over a data sample",
                         description="Per layer, the share of selections each expert gets over "
                         "a sample of validation data (dead experts crossed out), for every kind "
                         "of routing in the model: SwitchHead V/O experts, MoA heads, sigma-MoE "
                         "and Switch experts, and the fraction of tokens Mixture-of-Depths "
                         "routes through each block.")
    e.add_argument("--run", required=True, help="run directory")
    e.add_argument("--data", help="corpus name or path (default: the run's training corpus)")
    e.add_argument("--split", default="valid", choices=("train", "valid", "test"),
                   help="the corpus split whose text the model routes")
    e.add_argument("--tokens", type=int, default=16384, help="tokens in the sample "
                   "(default 16384)")
    e.add_argument("--batch-size", type=int, default=4, help="streams side by side (default 4)")
    e.add_argument("--out", required=True, help="output PNG path")
    e.add_argument("--json", action="store_true", help="print the usage tables as JSON")
    e.set_defaults(func=run_experts)

    c = kinds.add_parser("curves", help="training and validation curves of several runs",
                         description="Training and validation bpc (byte-level runs) or "
                         "perplexity against training tokens and against training time, one "
                         "line per run.")
    c.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories")
    c.add_argument("--labels", help="comma-separated labels (default: directory names)")
    c.add_argument("--title", help="figure title")
    c.add_argument("--out", required=True, help="output PNG path")
    c.set_defaults(func=run_curves)


def _check_out(path: str) -> None:
    if not path.lower().endswith(".png"):
        raise ValueError(f"--out must name a .png file, got {path}")


def run_attention(args) -> int:
    from moeify.analysis.attention_maps import compute_attention_maps, format_entropy, \
        plot_attention
    from moeify.rundir import load_trained

    _check_out(args.out)
    run = load_trained(args.run)
    ids = run.tokenizer.encode(args.text)
    T = run.model_config.context_length
    if len(ids) > T:
        print(f"note: the text has {len(ids)} tokens; using the first {T} (the context length)",
              file=sys.stderr)
        ids = ids[:T]
    maps = compute_attention_maps(run.model, ids, layer=args.layer, tokenizer=run.tokenizer)
    out = plot_attention(maps, args.out)
    if args.json:
        print(json.dumps({**maps.to_dict(), "out": str(out)}, indent=2))
    else:
        print(format_entropy(maps))
        print(f"wrote {out}")
    return 0


def run_experts(args) -> int:
    from moeify.analysis.experts import expert_usage, format_usage, plot_experts
    from moeify.rundir import load_trained
    from moeify.data import load_corpus, tokenize_split

    _check_out(args.out)
    if args.tokens < 1 or args.batch_size < 1:
        raise ValueError("--tokens and --batch-size must be positive")
    run = load_trained(args.run)
    from moeify.rundir.data import run_corpus_spec

    data = args.data or run_corpus_spec((run.train_config or {}).get("data"), run.run_dir)
    tokens = tokenize_split(load_corpus(data), run.tokenizer, args.split)
    tables = expert_usage(run.model, tokens, batch_size=args.batch_size, max_tokens=args.tokens)
    name = Path(args.run).resolve().name
    out = plot_experts(tables, args.out, title=f"expert usage: {name} on {data} {args.split} "
                       f"({min(args.tokens, len(tokens))} tokens)")
    if args.json:
        print(json.dumps({"tables": [t.to_dict() for t in tables], "out": str(out)}, indent=2))
    else:
        print(format_usage(tables))
        print(f"wrote {out}")
    return 0


def run_curves(args) -> int:
    from moeify.analysis.curves import load_curve, plot_curves

    _check_out(args.out)
    labels = args.labels.split(",") if args.labels else [None] * len(args.runs)
    if len(labels) != len(args.runs):
        raise ValueError(f"--labels has {len(labels)} entries for {len(args.runs)} runs")
    curves = [load_curve(r, lab) for r, lab in zip(args.runs, labels)]
    out = plot_curves(curves, args.out, title=args.title)
    for c in curves:
        last = f"{c.final_valid:.4f}" if c.final_valid is not None else "-"
        print(f"{c.label}: final validation {c.metric} {last}")
    print(f"wrote {out}")
    return 0
