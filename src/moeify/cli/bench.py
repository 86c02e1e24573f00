"""``moeify bench ...``: benchmarks that print a table, or JSON with --json."""

from __future__ import annotations

import argparse
import os
import sys

from moeify.cli.argtypes import nonnegative_int, positive_int


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: speed and memory, printed as a table or JSON",
                       description="Benchmarks measured side by side in one run (warm-up, median "
                       "of repeats). Add --json for machine-readable output.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for add in (_add_expert_matmul, _add_attention, _add_step, _add_ff, _add_generate,
                _add_contract):
        add(bsub)


def _add_expert_matmul(bsub) -> None:
    """``moeify bench expert-matmul``."""
    em = bsub.add_parser("expert-matmul", help="expert-matmul implementations vs the equal-MAC "
                         "dense matmuls (forward+backward); the per-device kernel table",
                         description="Every expert-matmul implementation (ops/moe/kernels/, "
                         "ops/moe/cpu/) on M random rows routed to K of E experts with gates, "
                         "[M, D] x [E, D, F], forward+backward, each output first checked "
                         "against the reference, against the two dense matmuls with the same "
                         "multiply-adds ([M*K, D] x [D, F] route-shaped, [M, D] x [D, K*F] "
                         "concatenated): median time of the repeats and the ratios. With "
                         "--preset-shapes: the presets' layer shapes, and the kernel table "
                         "that expert_impl=auto reads on CUDA (--write-table).")
    em.add_argument("--rows", "-M", type=int, default=8192, dest="M", help="rows (tokens)")
    em.add_argument("-K", type=int, default=2, help="experts per row")
    em.add_argument("-E", type=int, default=8, help="number of experts")
    em.add_argument("-D", type=int, default=512, help="input width")
    em.add_argument("-F", type=int, default=64, help="output width")
    em.add_argument("--groups", type=positive_int, default=1,
                    help="gated sums over this many groups of the K (SwitchHead's value "
                    "experts: the heads); default 1")
    em.add_argument("--sum-rows", type=positive_int, default=1, dest="sum_rows",
                    help="gated sums over this many consecutive rows (SwitchHead's output "
                    "experts: the heads); default 1")
    em.add_argument("--preset-shapes", action="store_true",
                    help="instead of one shape, every expert-matmul shape of the --table-preset "
                    "layers at --batch (SwitchHead's value and output experts): the per-device "
                    "kernel table that expert_impl=auto reads on CUDA")
    em.add_argument("--table-preset", action="append", metavar="NAME",
                    help="preset whose shapes --preset-shapes measures (repeatable; default "
                    "wt103-47m-switchhead and wt103-262m-switchhead)")
    em.add_argument("--batch", type=positive_int, default=64,
                    help="sequences per batch for --preset-shapes (default 64, the paper's)")
    em.add_argument("--write-table", metavar="PATH",
                    help="with --preset-shapes: write the kernel table there (e.g. "
                    "src/moeify/ops/moe/tables/h100.json for the H100 class)")
    _device_options(em, dtype_help="the tensors' dtype")
    em.add_argument("--impl", action="append", help="only these implementations (repeatable)")
    em.add_argument("--repeats", type=positive_int, default=7, help="timed repeats (median)")
    em.add_argument("--peer", action="append", metavar="KIND=PATH",
                    help="also time another project's kernel from its file, checked against the "
                    "reference first (repeatable); KIND cvmm: the SwitchHead authors' cvmm.py "
                    "(CUDA only), e.g. --peer cvmm=moeut/moeut/cvmm.py")
    em.add_argument("--profile", action="store_true",
                    help="also profile one call of each case after the timing: the kernels it "
                    "launches (on CUDA; operations on the CPU), their count and time shares")
    _output_and_run(em, run_expert_matmul)


def _add_attention(bsub) -> None:
    """``moeify bench attention``."""
    at = bsub.add_parser(
        "attention", help="one attention layer per preset: dense, SwitchHead, MoA side by side",
        description="One attention layer at each preset's shapes (batch, T, XL memory), forward "
        "and forward+backward time and peak memory, grouped by shape with ratios to the group's "
        "dense baseline and the cost-accounting MAC and memory ratios beside them. The dense "
        "baseline is also timed as a textbook implementation (same weights).")
    _presets_option(at, "preset to include (repeatable; default: the WT103 47M dense, SwitchHead "
                        "and MoA H=4 rows and the RoPE 45M dense and SwitchHead rows)")
    at.add_argument("--batch", type=int, help="batch size (default: --tokens / T)")
    at.add_argument("--tokens", type=int, default=2048,
                    help="tokens per batch when --batch is not given (default 2048: 8 x 256, "
                    "4 x 512)")
    at.add_argument("--no-textbook", action="store_true", help="skip the textbook dense row")
    at.add_argument("--expert-impl", action="append", metavar="KERNEL", dest="expert_impls",
                    help="run each expert-attention case with this expert-matmul kernel forced "
                    "(repeatable, 'auto' for the policy's choice): rows 'NAME [KERNEL]'")
    at.add_argument("--ops", type=nonnegative_int, default=0, metavar="N",
                    help="also split each case's forward+backward by ATen operation (timed as "
                    "dispatched): GEMMs vs the rest, and the N slowest operations")
    _common(at)
    at.set_defaults(func=run_attention)


def _add_step(bsub) -> None:
    """``moeify bench step``."""
    st = bsub.add_parser(
        "step", help="a whole training step (fwd, bwd, clip, AdamW) of full models",
        description="A training step of each preset's full model side by side: time and peak "
        "memory (weights, gradients, optimizer state and activations), ratios to the first "
        "preset (or its dense baseline, added when the first has MoE attention), and the "
        "cost-accounting MAC ratios.")
    _presets_option(st, "preset to include, the first is the baseline (its paper row's dense "
                        "preset is put first when it has no dense attention; repeatable; default: "
                        "wt103-47m-dense, wt103-47m-switchhead, wt103-47m-moa-h4)")
    st.add_argument("--batch", type=int, default=4, help="sequences per training step")
    _common(st, warmup=1, compile=False)
    st.add_argument("--compile", nargs="?", type=_compile_modes, default=None,
                    const=list(STEP_COMPILE_MODES), metavar="MODES",
                    help="also time every model torch.compile'd, beside the eager one: rows "
                    "'NAME compiled' (mode default) and 'NAME cuda-graphs' (mode "
                    "reduce-overhead: CUDA graphs); --compile alone takes both, or name them "
                    "comma-separated")
    st.add_argument("--no-compiled-memory", action="store_true",
                    help="with --compile: measure the peak memory of the eager rows only (each "
                    "compiled row's measurement compiles again in a fresh process)")
    st.set_defaults(func=run_step)


def _add_ff(bsub) -> None:
    """``moeify bench ff``."""
    ff = bsub.add_parser(
        "ff", help="feedforward MoEs vs a dense MLP and Hugging Face's Mixtral MoE block",
        description="sigma-MoE, Switch (dropless and with capacity 1.25), a dense MLP with the "
        "same active multiply-adds and, when transformers is installed, Hugging Face's Mixtral "
        "sparse MoE block with each of its experts implementations (SwiGLU experts of "
        "intermediate size 2G/3: equal multiply-adds), side by side at the same shapes, forward "
        "and forward+backward.")
    ff.add_argument("--tokens", type=positive_int, default=4096, help="tokens per batch")
    ff.add_argument("--d-model", type=positive_int, default=512, help="model width d")
    ff.add_argument("--experts", type=positive_int, default=8, help="experts E")
    ff.add_argument("-k", type=positive_int, default=2, help="experts per token")
    ff.add_argument("--expert-size", type=positive_int, default=384,
                    help="hidden units per sigma-MoE / Switch expert (G)")
    ff.add_argument("--impl", action="append", metavar="IMPL",
                    help="moeify expert-matmul implementation(s) to time (repeatable; default "
                    "auto)")
    ff.add_argument("--hf-impl", action="append", metavar="IMPL",
                    help="only these Hugging Face experts implementations (repeatable; default "
                    "all installed)")
    ff.add_argument("--no-hf", action="store_true", help="skip the Hugging Face rows")
    _common(ff, memory=False, compile=False)
    ff.set_defaults(func=run_ff)


def _add_generate(bsub) -> None:
    """``moeify bench generate``."""
    ge = bsub.add_parser(
        "generate", help="prefill and per-token decode throughput and KV-cache size",
        description="Full models decoding through their KV cache, side by side: prefill "
        "tokens/s (in chunks of the model's context length), per-token decode tokens/s and the "
        "cache's bytes, at each context and batch size, with ratios to the dense preset of the "
        "same size. The full grid (4 contexts x 2 batches x 5 presets) takes long on a small "
        "machine: pick a subset with --context / --batch / --preset.")
    _presets_option(ge, "preset to include (repeatable; default: the WT103 47M dense, "
                        "SwitchHead and MoA H=4 rows and the RoPE 45M dense and SwitchHead rows)")
    ge.add_argument("--context", action="append", type=int, metavar="C",
                    help="tokens in the cache when decoding starts (repeatable; default 512, "
                    "1024, 2048, 4096)")
    ge.add_argument("--batch", action="append", type=int, metavar="B",
                    help="sequences decoded together (repeatable; default 1 and 8)")
    ge.add_argument("--tokens", type=positive_int, default=8, help="timed decode steps per cell")
    _common(ge, memory=False, repeats=False, compile=False)
    ge.set_defaults(func=run_generate)


def _add_contract(bsub) -> None:
    """``moeify bench contract``."""
    co = bsub.add_parser("contract", help="the cost contract: MACs, operators, host read-backs "
                         "and memory, counted (no timing; the same on every machine)",
                         description="Counts, for the SwitchHead 47M and 262M attention layers "
                         "and a 47M training step and their dense baselines, per expert kernel: "
                         "multiply-adds, operators dispatched, host read-backs, bytes allocated "
                         "and peak memory (docs/cost-contract.md). --write regenerates the "
                         "expectations the tests hold the code to.")
    co.add_argument("--write", action="store_true",
                    help="write the results to tests/bench/contract_expectations.json (under the "
                    "current directory: run it from the repository root)")
    _output_and_run(co, run_contract)


def run_contract(args) -> int:
    from moeify.bench.contract import bench_contract, expectations_path, table, write_expectations
    from moeify.bench.timing import emit

    res = bench_contract()
    if args.write:
        path = expectations_path()
        write_expectations(res, path)
        print(f"wrote {path}", file=sys.stderr)
    emit(res, table(res), args.json)
    return 0


def _common(p, warmup: int = 2, memory: bool = True, repeats: bool = True,
            compile: bool = True) -> None:
    _device_options(p, dtype_help="float32, or autocast to bfloat16 / float16 (weights stay "
                                  "float32)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--omp-wait", choices=["default", "passive"], default="default",
                   help="OpenMP wait policy: libgomp's default (idle threads spin a while, as "
                   "in training and generation), or passive (they sleep at once: fairer on a "
                   "machine busy with other jobs, slower for many small ops)")
    if repeats:
        p.add_argument("--repeats", type=positive_int, default=5,
                       help="timed repeats per case, interleaved (the median is reported)")
    p.add_argument("--warmup", type=nonnegative_int, default=warmup,
                   help="untimed runs of each case first")
    if memory:
        p.add_argument("--no-memory", action="store_true",
                       help="skip the peak-memory measurements (one fresh process per case)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    if compile:
        p.add_argument("--compile", action="store_true",
                       help="also time every case torch.compile'd, beside the eager one")


def _device_options(p, *, dtype_help: str) -> None:
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help=dtype_help)
    p.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda / cuda:N (timed with CUDA events)")


def _output_and_run(p, run) -> None:
    """--json (instead of the table) and the function that runs the bench."""
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _presets_option(p, help: str) -> None:
    p.add_argument("--preset", action="append", metavar="NAME", help=help)


# torch.compile modes of ``bench step --compile`` (moeify.bench.step.COMPILE_MODES; named here
# so that parsing the command line does not load torch).
STEP_COMPILE_MODES = ("default", "reduce-overhead")


def _compile_modes(value: str) -> list[str]:
    modes = [m for m in value.split(",") if m]
    if not modes or any(m not in STEP_COMPILE_MODES for m in modes):
        raise argparse.ArgumentTypeError(f"compile modes are a comma-separated list of "
                                         f"{', '.join(STEP_COMPILE_MODES)}; got {value!r}")
    return modes


def _openmp_policy(args) -> None:
    """``--omp-wait passive``: let idle OpenMP threads sleep between parallel regions. libgomp's
    default (what ``moeify train`` and ``generate`` run under) spins them for a while first. On
    an idle machine the default is the one to measure: with PASSIVE every parallel op pays a
    thread wake-up, measured here at about 0.2 ms for a [1, 412] x [412, 76] matmul on 2 threads
    (6 us with the default), which makes a decode step of many small ops look several times
    slower than it runs. On a machine busy with other jobs the spinning threads take the cores
    the working ones need, and PASSIVE is the fairer choice there. libgomp reads the policy when
    torch loads, so it is set before the first torch import; an OMP_WAIT_POLICY in the
    environment wins."""
    if getattr(args, "omp_wait", "default") == "passive" and "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is visible to torch "
                         f"{torch.__version__}; run on a machine with an NVIDIA GPU and a CUDA "
                         "build of torch, or use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: the benchmarks run on cpu or cuda")


def _setup_threads(args) -> None:
    _openmp_policy(args)
    import torch

    _check_device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)


def run_attention(args) -> int:
    _openmp_policy(args)  # before anything imports torch
    from moeify.bench.attention import DEFAULT_PRESETS, bench_attention, table
    from moeify.bench.timing import emit

    _setup_threads(args)
    res = bench_attention(args.preset or DEFAULT_PRESETS, batch=args.batch, tokens=args.tokens,
                          device=args.device, dtype=args.dtype, textbook=not args.no_textbook,
                          memory=not args.no_memory, warmup=args.warmup, repeats=args.repeats,
                          compile=args.compile, ops=args.ops,
                          expert_impls=tuple(args.expert_impls or ()))
    emit(res, table(res), args.json)
    return 0


def run_step(args) -> int:
    _openmp_policy(args)  # before anything imports torch
    from moeify.bench.step import DEFAULT_STEP_PRESETS, bench_step, table
    from moeify.bench.timing import emit

    _setup_threads(args)
    res = bench_step(args.preset or DEFAULT_STEP_PRESETS, batch=args.batch, device=args.device,
                     dtype=args.dtype, memory=not args.no_memory, warmup=args.warmup,
                     repeats=args.repeats, compile=args.compile,
                     compiled_memory=not args.no_compiled_memory)
    emit(res, table(res), args.json)
    return 0


def run_expert_matmul(args) -> int:
    import torch

    from moeify.bench.expert_matmul import bench_expert_matmul, table
    from moeify.bench.peers import load_peer, parse_peer
    from moeify.bench.timing import emit

    _check_device(args.device)

    if args.write_table and not args.preset_shapes:
        raise ValueError("--write-table writes the table of --preset-shapes: add it")
    if args.preset_shapes:
        from moeify.bench.expert_matmul import TABLE_PRESETS, bench_kernel_table, table_summary

        if args.peer or args.profile:
            raise ValueError("--preset-shapes measures the kernel table: run --peer and "
                             "--profile at one shape")
        res = bench_kernel_table(tuple(args.table_preset or TABLE_PRESETS), batch=args.batch,
                                 dtype=getattr(torch, args.dtype), device=args.device,
                                 impls=args.impl, repeats=args.repeats, path=args.write_table)
        emit(res, table_summary(res), args.json)
        return 0
    peers = {}
    for spec in args.peer or ():
        kind, path = parse_peer(spec)
        peers[kind] = load_peer(kind, path)
    res = bench_expert_matmul(args.M, args.K, args.E, args.D, args.F, groups=args.groups,
                              sum_rows=args.sum_rows, dtype=getattr(torch, args.dtype),
                              device=args.device, impls=args.impl, repeats=args.repeats,
                              profile=args.profile, peers=peers)
    emit(res, table(res), args.json)
    return 0


def run_ff(args) -> int:
    _openmp_policy(args)  # before anything imports torch
    from moeify.bench.ff import bench_ff, table
    from moeify.bench.timing import emit

    _setup_threads(args)
    res = bench_ff(tokens=args.tokens, d_model=args.d_model, n_experts=args.experts, k=args.k,
                   expert_size=args.expert_size, impls=args.impl or ["auto"], hf=not args.no_hf,
                   hf_impls=args.hf_impl, warmup=args.warmup, repeats=args.repeats,
                   device=args.device, dtype=args.dtype)
    emit(res, table(res), args.json)
    return 0


def run_generate(args) -> int:
    _openmp_policy(args)  # before anything imports torch
    from moeify.bench.generate import (
        DEFAULT_BATCHES,
        DEFAULT_CONTEXTS,
        DEFAULT_GENERATE_PRESETS,
        bench_generate,
        table,
    )
    from moeify.bench.timing import emit

    _setup_threads(args)
    res = bench_generate(args.preset or DEFAULT_GENERATE_PRESETS,
                         contexts=args.context or DEFAULT_CONTEXTS,
                         batches=args.batch or DEFAULT_BATCHES, tokens=args.tokens,
                         warmup=args.warmup, device=args.device, dtype=args.dtype)
    emit(res, table(res), args.json)
    return 0
