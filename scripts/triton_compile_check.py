"""Compile every Triton expert-matmul kernel, in every autotune configuration, for Hopper
(sm_90) without a GPU: catches compile errors and shared-memory overflow before a GPU run, and
says whether each kernel's loads are vectorised.

    python scripts/triton_compile_check.py [--arch 90] [--json] [--largest] [--unpadded] [--mlp]

bf16 operands (fp32 atomic buffers) at the 47M SwitchHead value shape (D 412, F 76, E 10,
K 4), specialised as a launch specialises them: unit strides become constants, and the
pointers (torch's allocations are 16-byte aligned) and every integer divisible by 16 are marked
so. The kernel wrapper pads D and F to 416 and 80 (moeify.ops.moe.kernels.scatter_gemm, "Aligned
widths"), so the widths and row strides are marked too; ``--unpadded`` compiles them as 412 and
76 instead, as a launch without the padding sees them; ``--mlp`` compiles the expert MLP's
variants (the hidden units read or written in expert order) instead of the expert matmul's.
Each row reports the PTX's global memory traffic: ``vector`` when the tiles move by
asynchronous copies (``cp.async``) and no 2-byte load or store and no one-at-a-time fp32
atomic is left, ``scalar`` otherwise. Exits non-zero when a kernel fails to compile or needs more shared memory than one block may have (227 KiB on sm_90, 99 KiB on
sm_86/89, 163 KiB on sm_80), or, padded, when a kernel is not vectorised. Runs the real
compiler (ptxas is bundled with triton); TRITON_INTERPRET is cleared for this process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from moeify.ops.moe.kernels import _triton_jit as tk  # noqa: E402
from moeify.ops.moe.kernels.scatter_gemm import PAIR, ROW, SORTED  # noqa: E402

SHARED_LIMIT = {90: 232448, 80: 166912, 86: 101376, 89: 101376}
E, E_P2 = 10, 16
D, F, D16, F16 = 412, 76, 416, 80
# The integer arguments that are widths or row strides: divisible by 16 once padded.
WIDTHS = {"D", "F", "sxm", "swe", "swd"}


def attrs(fn, sig: dict, padded: bool) -> dict:
    """The divisibility marks a launch gives: every pointer, and (padded) every width and row
    stride (D16, F16 and their products are multiples of 16; 412 and 76 are not)."""
    return {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
            if a in sig and (sig[a].startswith("*") or (padded and a in WIDTHS))}


# Element-by-element global traffic: 2-byte loads and stores, fp32 atomics one at a time.
SCALAR = re.compile(r"\b(ld\.global\.b16|st\.global\.b16|red\.global(\.\w+)*\.add\.f32)\b")


def traffic(ptx: str) -> str:
    """``vector``: tiles copied into shared memory by cp.async, and no 2-byte global load or
    store and no one-at-a-time fp32 atomic left (stores and atomics move 4-wide)."""
    return "vector" if "cp.async" in ptx and not SCALAR.search(ptx) else "scalar"


def signatures(mlp: bool = False):
    """(name, kernel, signature, constexprs, configs) of each kernel variant to compile: the
    expert matmul's (x at the input rows, products in pair order); with ``mlp``, the expert
    MLP's instead (its hidden units in expert order: the rows modes of scatter_gemm)."""
    bf, f32, i32, i64p, i32p = "*bf16", "*fp32", "i32", "*i64", "*i32"
    common = dict(E=E, E_P2=E_P2, PRECISION="tf32")
    fwd_sig = dict(x_ptr=bf, w_ptr=bf, y_ptr=bf, order_ptr=i64p, offsets_ptr=i32p, N=i32, D=i32,
                   F=i32, K=i32, sxm=i32, sxd="constexpr", swe=i32, swd=i32, swf="constexpr")
    bwd_x_sig = dict(grad_ptr=bf, w_ptr=bf, gx_ptr=f32, order_ptr=i64p, offsets_ptr=i32p, N=i32,
                     D=i32, F=i32, K=i32, sxm=i32, sxd="constexpr", swe=i32, swd=i32,
                     swf="constexpr")
    bwd_w_sig = dict(x_ptr=bf, grad_ptr=bf, gw_ptr=f32, order_ptr=i64p, offsets_ptr=i32p,
                     N=i32, D=i32, F=i32, K=i32, sxm=i32, sxd="constexpr")
    fwd, bwd_x = dict(common, sxd=1, swf=1), dict(common, ATOMIC=True, sxd=1, swf=1)
    bwd_w = dict(common, sxd=1)
    if mlp:
        yield ("fwd (hidden out, expert order)", tk._fwd, fwd_sig,
               dict(fwd, X_ROWS=ROW, Y_ROWS=SORTED), tk.FWD_CONFIGS)
        yield ("fwd (hidden in, expert order)", tk._fwd, fwd_sig,
               dict(fwd, X_ROWS=SORTED, Y_ROWS=PAIR), tk.FWD_CONFIGS)
        yield ("bwd_x (grad in expert order)", tk._bwd_x, bwd_x_sig,
               dict(bwd_x, G_ROWS=SORTED), tk.BWD_X_CONFIGS)
        yield ("bwd_w (x in expert order)", tk._bwd_w, bwd_w_sig,
               dict(bwd_w, X_ROWS=SORTED, G_ROWS=ROW), tk.BWD_W_CONFIGS)
        yield ("bwd_w (grad in expert order)", tk._bwd_w, bwd_w_sig,
               dict(bwd_w, X_ROWS=ROW, G_ROWS=SORTED), tk.BWD_W_CONFIGS)
        return
    yield ("fwd", tk._fwd, fwd_sig, dict(fwd, X_ROWS=ROW, Y_ROWS=PAIR), tk.FWD_CONFIGS)
    yield ("bwd_x", tk._bwd_x, bwd_x_sig, dict(bwd_x, G_ROWS=PAIR), tk.BWD_X_CONFIGS)
    yield ("bwd_x (K=1, stores)", tk._bwd_x, dict(bwd_x_sig, gx_ptr=bf),
           dict(bwd_x, ATOMIC=False, G_ROWS=PAIR), tk.BWD_X_CONFIGS)
    yield ("bwd_w", tk._bwd_w, bwd_w_sig, dict(bwd_w, X_ROWS=ROW, G_ROWS=PAIR),
           tk.BWD_W_CONFIGS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--largest", action="store_true",
                    help="only each kernel's largest configuration (tiles x stages): the one "
                    "closest to the shared-memory limit; a few seconds (the test suite's check)")
    ap.add_argument("--mlp", action="store_true",
                    help="the expert MLP's variants instead (hidden units in expert order)")
    ap.add_argument("--unpadded", action="store_true",
                    help="compile for widths 412 and 76 as given (no divisibility marks on "
                    "widths and strides), as a launch with MOEIFY_TRITON_PAD=0 sees them")
    args = ap.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    limit = SHARED_LIMIT.get(args.arch, 101376)
    rows, failed = [], 0
    for name, fn, sig, consts, configs in signatures(args.mlp):
        if args.largest:
            configs = [max(configs, key=lambda c: c.num_stages * c.kwargs["BLOCK_M"]
                           * c.kwargs["BLOCK_D"] * c.kwargs["BLOCK_F"])]
        for cfg in configs:
            meta = dict(consts, **cfg.kwargs)
            full_sig = {a: ("constexpr" if a in meta else sig[a]) for a in fn.arg_names}
            row = dict(kernel=name, config=cfg.kwargs, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages)
            try:
                src = triton.compiler.ASTSource(fn, full_sig, constexprs=meta,
                                                attrs=attrs(fn, sig, not args.unpadded))
                k = triton.compile(src, target=target,
                                   options=dict(num_warps=cfg.num_warps,
                                                num_stages=cfg.num_stages))
                row.update(shared=k.metadata.shared, traffic=traffic(k.asm["ptx"]),
                           ok=k.metadata.shared <= limit)
                if not row["ok"]:
                    row["error"] = f"shared memory {k.metadata.shared} > {limit}"
                elif not args.unpadded and row["traffic"] != "vector":
                    row.update(ok=False, error="scalar loads at padded widths")
            except Exception as exc:  # noqa: BLE001 - report every failure, then exit non-zero
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            failed += not row["ok"]
            rows.append(row)
    if args.json:
        print(json.dumps(dict(arch=args.arch, triton=triton.__version__,
                              widths=[D, F] if args.unpadded else [D16, F16], rows=rows),
                         indent=1))
    else:
        for r in rows:
            status = f"shared {r['shared']:>6} B {r['traffic']}" if "shared" in r else ""
            print(f"{'ok  ' if r['ok'] else 'FAIL'} sm_{args.arch} {r['kernel']:<22} "
                  f"{r['config']} warps {r['num_warps']} stages {r['num_stages']} {status} "
                  f"{r.get('error', '')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
