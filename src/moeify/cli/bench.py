"""``moeify bench ...``: benchmarks that print a table, or JSON with --json."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: speed and memory, printed as a table or JSON",
                       description="Benchmarks measured side by side in one run (warm-up, median "
                       "of repeats). Add --json for machine-readable output.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)

    em = bsub.add_parser("expert-matmul", help="expert-matmul implementations vs an equal-MAC "
                         "dense matmul (forward+backward)")
    em.add_argument("--rows", "-M", type=int, default=8192, dest="M")
    em.add_argument("-K", type=int, default=2, help="experts per row")
    em.add_argument("-E", type=int, default=8, help="number of experts")
    em.add_argument("-D", type=int, default=512, help="input width")
    em.add_argument("-F", type=int, default=64, help="output width")
    em.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    em.add_argument("--device", default="cpu")
    em.add_argument("--impl", action="append", help="only these implementations (repeatable)")
    em.add_argument("--repeats", type=int, default=7)
    em.add_argument("--json", action="store_true", help="print JSON instead of a table")
    em.set_defaults(func=run_expert_matmul)


def run_expert_matmul(args) -> int:
    import torch

    from moeify.bench.expert_matmul import bench_expert_matmul, table
    from moeify.bench.timing import emit

    res = bench_expert_matmul(args.M, args.K, args.E, args.D, args.F,
                              dtype=getattr(torch, args.dtype), device=args.device,
                              impls=args.impl, repeats=args.repeats)
    emit(res, table(res), args.json)
    return 0
