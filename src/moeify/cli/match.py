"""``moeify match``: parameter-match SwitchHead or MoA to a dense preset (SwitchHead §3)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("match", help="choose d_head and d_ff to parameter-match a dense preset",
                       description="Replace the attention of a dense preset with SwitchHead "
                       "(or MoA) and choose d_head (largest multiple of 4 with no more attention "
                       "parameters than the dense layer) and d_ff (absorbing the rest), as the "
                       "SwitchHead paper did; report the parameter difference.")
    p.add_argument("--preset", required=True, help="the dense baseline, e.g. wt103-47m-dense")
    p.add_argument("--heads", "-H", type=int, required=True,
                   help="heads H (MoA: selected heads)")
    p.add_argument("--experts", "-E", type=int, required=True, help="experts per head E "
                   "(MoA: expert heads)")
    p.add_argument("-k", type=int, default=None, help="active experts per head (SwitchHead)")
    p.add_argument("--kind", choices=["switchhead", "moa"], default="switchhead",
                   help="the attention that replaces the dense one")
    p.add_argument("--projections", default="vo",
                   help="SwitchHead projections that are experts, a subset of qkvo (default vo)")
    p.add_argument("--shared-selection", action="store_true",
                   help="one selection matrix for V and O")
    p.add_argument("--d-head", type=int, default=None, help="fix d_head instead of choosing it")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    from moeify.models.cost import format_count
    from moeify.models.presets import match_preset

    if not set(args.projections) <= set("qkvo"):
        raise ValueError(f"--projections must be letters from qkvo, got {args.projections!r}")
    r = match_preset(args.preset, n_heads=args.heads, n_experts=args.experts, k=args.k,
                     kind=args.kind, experts=tuple(args.projections),
                     shared_selection=args.shared_selection, d_head=args.d_head)
    if args.json:
        print(json.dumps({"preset": args.preset, **r.to_dict(),
                          "config": r.config.to_dict()}, indent=2))
        return 0
    print(f"{args.kind} H={args.heads} E={args.experts} k={args.k} against {args.preset}:")
    print(f"  d_head = {r.d_head}, d_ff = {r.d_ff} (ff_multiplier {r.ff_multiplier:.2f})")
    print(f"  attention parameters per layer: {r.attention_params:,} "
          f"(dense {r.dense_attention_params:,})")
    print(f"  total parameters: {r.params:,} ({format_count(r.params)}) vs dense "
          f"{r.dense_params:,}: {r.difference:+,} ({100 * r.relative_difference:+.3f}%)")
    return 0
