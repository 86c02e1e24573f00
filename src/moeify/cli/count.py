"""``moeify count``: parameters, and per attention layer MACs and memory (moeify.models.cost)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("count", help="parameters, attention MACs and memory of a preset, a run "
                       "(--run) or a ModelConfig JSON file (--config)",
                       description="Count the parameters of a model (built on the meta device: "
                       "no weights are allocated) and, per attention layer, the MACs and memory "
                       "of one sequence with the formulas that printed the SwitchHead paper's "
                       "tables; for a model with MoSA layers also the forward FLOPs of the "
                       "MoSA paper's App. A; for MoH layers also the MACs of the activated heads "
                       "alone (the MoH paper's measure). Add --json for the exact integers.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="preset name (see `moeify presets`)")
    src.add_argument("--config", help="a ModelConfig JSON file (e.g. a run directory's)")
    src.add_argument("--run", help="a run directory (its model.json), e.g. one made by "
                     "`moeify import`")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def load_config(args):
    from pathlib import Path

    from moeify.errors import read_utf8
    from moeify.models.config import ModelConfig
    from moeify.models.presets import get_preset

    if args.preset is not None:
        return args.preset, get_preset(args.preset)
    if args.run is not None:
        from moeify.rundir.files import read_model_config

        return args.run, read_model_config(args.run)
    if Path(args.config).is_dir():
        raise ValueError(f"--config {args.config} is a directory: for a run directory use "
                         f"--run {args.config}; --config takes a ModelConfig JSON file")
    try:
        return args.config, ModelConfig.from_json(read_utf8(args.config))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{args.config} is not a ModelConfig JSON file ({e})") from None


def run(args) -> int:
    import json

    from moeify.models.cost import format_count, model_cost

    name, config = load_config(args)
    cost = model_cost(config)
    if args.json:
        print(json.dumps({"name": name, **cost.to_dict()}, indent=2))
        return 0
    print(f"{name}: {format_count(cost.params)} parameters ({cost.params:,})")
    print("  " + ", ".join(f"{part} {n:,}" for part, n in cost.params_by_part.items() if n))
    if cost.mosa_paper_flops is not None:
        print(f"forward pass: {cost.mosa_paper_flops / 1e9:,.2f} GFLOPs as MoSA's paper counts "
              "them (arXiv 2505.00315 App. A: whole model, 2 per multiply-add; its IsoFLOP "
              "rows stay within their dense baseline's)")
    for r in cost.remoe:
        print(f"ReMoE feedforward, per token: router {r['router_macs']:,} MACs + "
              f"{r['macs_per_active_expert']:,} per active expert; the experts per token are "
              f"measured (the 'experts_per_token' statistic of training), at the target "
              f"k={r['experts_per_token']:g}: {r['macs_per_token']:,.0f} MACs")
    print(f"per attention layer, one sequence of T={cost.T} (C={cost.C}); memory: values held "
          "and their float32 size:")
    width = max(len(r["attention"]) for r in cost.layers)
    print(f"  {'layers':<8} {'attention':<{width}} {'tokens':>6} {'MACs':>8} {'memory':>14} "
          f"{'fp32':>9}")
    for first, last, row in _runs(cost.layers):
        span = str(first) if first == last else f"{first}-{last}"
        mib = row["memory"] * 4 / 2**20
        print(f"  {span:<8} {row['attention']:<{width}} {row['tokens']:>6} {row['macs_str']:>8} "
              f"{row['memory_str'] + ' values':>14} {f'{mib:.1f} MiB':>9}")
    sparse = [(first, last, row) for first, last, row in _runs(cost.layers)
              if "activated_head_macs" in row]
    if sparse:
        print("  activated-head MACs (MoH paper's measure, its Table 7's sparse kernel; moeify "
              "computes every head): " + ", ".join(
            f"layers {a}-{b} {r['activated_head_macs_str']}" if a != b
            else f"layer {a} {r['activated_head_macs_str']}" for a, b, r in sparse))
    return 0


def _runs(layers):
    """Group consecutive layers with identical cost rows."""
    out = []
    for row in layers:
        key = {k: v for k, v in row.items() if k != "layer"}
        if out and out[-1][2] == key:
            out[-1][1] = row["layer"]
        else:
            out.append([row["layer"], row["layer"], key])
    return out
