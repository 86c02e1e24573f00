"""Print the medians of the benchmark ratios that scripts/compare_trees.sh measured for two
source trees, side by side (JSON with --json):

    python scripts/compare_trees.py OUT [--json]

Ratios are each tree's own side-by-side measurements (a case over its dense baseline in the
same process); "better" means lower time ratios and higher decode-speed ratios.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

# (benchmark, how to list its rows, the ratio columns, whether higher is better)
METRICS = {
    "ff": (lambda d: d["rows"], ("fwd+bwd x dense", "fwd+bwd x HF best"), False),
    "attention": (lambda d: [r for g in d["groups"] for r in g["rows"]], ("fwd+bwd x",), False),
    "generate": (lambda d: [dict(r, case=f"{r['case']} b{r['batch']}") for c in d["cells"]
                            for r in c["rows"]], ("decode x", "prefill x"), True),
    "step": (lambda d: d["rows"], ("time x",), False),
}


def collect(out: str, tree: str) -> dict:
    """{(bench, case, column): [value per run]}."""
    vals: dict = {}
    for name, (rows, cols, _) in METRICS.items():
        for path in sorted(glob.glob(os.path.join(out, f"{tree}_{name}_*.json"))):
            with open(path) as f:
                data = json.load(f)
            for row in rows(data):
                for col in cols:
                    if row.get(col) is not None:
                        vals.setdefault((name, row["case"], col), []).append(row[col])
    return vals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    old, new = collect(args.out, "old"), collect(args.out, "new")
    if not old or not new:
        print(f"no results for both trees in {args.out}", file=sys.stderr)
        return 2
    rows = []
    for key in sorted(set(old) & set(new)):
        o, n = statistics.median(old[key]), statistics.median(new[key])
        if o == 1.0 and n == 1.0:
            continue  # a baseline row
        higher = METRICS[key[0]][2]
        rows.append(dict(bench=key[0], case=key[1], ratio=key[2], old=o, new=n,
                         runs=len(new[key]), better_or_equal=(n >= o) if higher else (n <= o)))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| bench | case | ratio | old | new | runs |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bench']} | {r['case']} | {r['ratio']} | {r['old']:.3f} | {r['new']:.3f} | "
              f"{r['runs']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
