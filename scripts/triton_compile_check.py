"""Compile every Triton expert-matmul kernel, in every autotune configuration, for Hopper
(sm_90) without a GPU: catches compile errors and shared-memory overflow before a GPU run.

    python scripts/triton_compile_check.py [--arch 90] [--json] [--largest]

bf16 operands (fp32 atomic buffers) at the 47M SwitchHead value shape (D 412, F 76, E 10,
K 4): the runtime widths are not multiples of 16, so no divisibility
hints, as at that shape; unit strides are specialised to constants as the launcher does. Exits
non-zero when a kernel fails to compile or needs more shared memory than one block may have
(227 KiB on sm_90, 99 KiB on sm_86/89, 163 KiB on sm_80). Runs the real compiler (ptxas is
bundled with triton); TRITON_INTERPRET is cleared for this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from moeify.ops.moe.kernels import _triton_jit as tk  # noqa: E402

SHARED_LIMIT = {90: 232448, 80: 166912, 86: 101376, 89: 101376}
E, E_P2 = 10, 16


def signatures():
    """(name, kernel, signature, constexprs, configs) of each kernel variant to compile."""
    bf, f32, i32, i64p, i32p = "*bf16", "*fp32", "i32", "*i64", "*i32"
    common = dict(E=E, E_P2=E_P2, PRECISION="tf32")
    fwd_sig = dict(x_ptr=bf, w_ptr=bf, y_ptr=bf, order_ptr=i64p, offsets_ptr=i32p, N=i32, D=i32,
                   F=i32, K=i32, sxm=i32, sxd="constexpr", swe=i32, swd=i32, swf="constexpr")
    yield ("fwd", tk._fwd, fwd_sig, dict(common, sxd=1, swf=1), tk.FWD_CONFIGS)
    for atomic in (True, False):
        sig = dict(grad_ptr=bf, w_ptr=bf, gx_ptr=f32 if atomic else bf, order_ptr=i64p,
                   offsets_ptr=i32p, N=i32, D=i32, F=i32, K=i32, sxm=i32, sxd="constexpr",
                   swe=i32, swd=i32, swf="constexpr")
        yield (f"bwd_x{'' if atomic else ' (K=1, stores)'}", tk._bwd_x, sig,
               dict(common, ATOMIC=atomic, sxd=1, swf=1), tk.BWD_X_CONFIGS)
    sig = dict(x_ptr=bf, grad_ptr=bf, gw_ptr=f32, order_ptr=i64p, offsets_ptr=i32p, N=i32,
               D=i32, F=i32, K=i32, sxm=i32, sxd="constexpr")
    yield "bwd_w", tk._bwd_w, sig, dict(common, sxd=1), tk.BWD_W_CONFIGS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--largest", action="store_true",
                    help="only each kernel's largest configuration (tiles x stages): the one "
                    "closest to the shared-memory limit; a few seconds (the test suite's check)")
    args = ap.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    limit = SHARED_LIMIT.get(args.arch, 101376)
    rows, failed = [], 0
    for name, fn, sig, consts, configs in signatures():
        if args.largest:
            configs = [max(configs, key=lambda c: c.num_stages * c.kwargs["BLOCK_M"]
                           * c.kwargs["BLOCK_D"] * c.kwargs["BLOCK_F"])]
        for cfg in configs:
            meta = dict(consts, **cfg.kwargs)
            full_sig = {a: ("constexpr" if a in meta else sig[a]) for a in fn.arg_names}
            row = dict(kernel=name, config=cfg.kwargs, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages)
            try:
                src = triton.compiler.ASTSource(fn, full_sig, constexprs=meta)
                k = triton.compile(src, target=target,
                                   options=dict(num_warps=cfg.num_warps,
                                                num_stages=cfg.num_stages))
                row.update(shared=k.metadata.shared, ok=k.metadata.shared <= limit)
                if not row["ok"]:
                    row["error"] = f"shared memory {k.metadata.shared} > {limit}"
            except Exception as exc:  # noqa: BLE001 - report every failure, then exit non-zero
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            failed += not row["ok"]
            rows.append(row)
    if args.json:
        print(json.dumps(dict(arch=args.arch, triton=triton.__version__, rows=rows), indent=1))
    else:
        for r in rows:
            status = f"shared {r['shared']:>6} B" if "shared" in r else ""
            print(f"{'ok  ' if r['ok'] else 'FAIL'} sm_{args.arch} {r['kernel']:<22} "
                  f"{r['config']} warps {r['num_warps']} stages {r['num_stages']} {status} "
                  f"{r.get('error', '')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
