"""``moeify presets``: list the named model presets, one line each on what they build."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("presets", help="list the model presets (paper rows and tiny CPU models)",
                       description="List every named preset with a one-line description of what "
                       "it builds. Names follow {dataset}-{size}-{model}[-{variant}]; tiny-* "
                       "presets train on a CPU in minutes.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    from moeify.models.presets import PRESETS

    if args.json:
        print(json.dumps([{"name": p.name, "description": p.description}
                          for p in PRESETS.values()], indent=2))
        return 0
    width = max(len(n) for n in PRESETS)
    for p in PRESETS.values():
        print(f"{p.name:<{width}}  {p.description}")
    return 0
