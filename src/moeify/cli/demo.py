"""``moeify demo``: a few seconds showing the expert matmul against its reference."""

from __future__ import annotations


def register(sub) -> None:
    from moeify.cli.argtypes import positive_int

    p = sub.add_parser("demo", help="show the expert-matmul primitive on random data (seconds)",
                       description="Route random rows to experts with sigmoid top-k, run every "
                       "expert-matmul implementation and compare it with the dense reference.")
    p.add_argument("--rows", type=positive_int, default=2048, help="rows (tokens) routed")
    p.add_argument("--experts", type=positive_int, default=8, help="experts to route among")
    p.add_argument("--k", type=positive_int, default=2, help="experts chosen per row")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    if args.k > args.experts:
        raise ValueError(f"--k {args.k} is larger than --experts {args.experts}: each row "
                         "picks k of the experts")
    from moeify.ops import expert_matmul, sigmoid_topk
    from moeify.ops.moe import IMPLEMENTATIONS, make_plan
    from moeify.ops.moe.kernels.scatter_gemm import unavailable_reason

    torch.manual_seed(0)
    D, F = 128, 64
    x = torch.randn(args.rows, D)
    router = torch.randn(D, args.experts) / D**0.5
    w = torch.randn(args.experts, D, F) / D**0.5
    route = sigmoid_topk(x @ router, args.k)
    print(f"{args.rows} rows -> top-{args.k} of {args.experts} experts (sigmoid gates); "
          f"rows per expert: {torch.bincount(route.idx.flatten(), minlength=args.experts).tolist()}")
    ref = expert_matmul(x, route.idx, w, route.gates, impl="reference")
    # One sort shared by every implementation; all experts form one group, so each row's k
    # experts are a set and "sets" applies too.
    plan = make_plan(route.idx, args.experts, group_size=args.experts)
    for impl in IMPLEMENTATIONS:
        if impl == "triton" and unavailable_reason(x) is not None:
            print(f"  {impl:<10} skipped: needs CUDA (or Triton's interpreter) and triton")
            continue
        y = expert_matmul(x, route.idx, w, route.gates, impl=impl, plan=plan)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        print(f"  {impl:<10} output {tuple(y.shape)}  max relative difference to reference {err:.1e}")
    return 0
