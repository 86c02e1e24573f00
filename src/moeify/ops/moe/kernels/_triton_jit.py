"""The Triton kernels of the "triton" expert kernel (their design:
moeify.ops.moe.kernels.scatter_gemm, which imports this module only when triton is installed
and a kernel is first needed).

Triton resolves the names a kernel calls from its module's globals, so the kernels live at the
top level of a module of their own, which imports triton unconditionally.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from moeify.errors import env_flag

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _tile(pid, offsets_ptr, N, E: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr):
    """Tile ``pid`` of the per-expert tiling of the sorted pairs: its expert, its first
    sorted position and the end of that expert's pairs. A program past the last tile gets
    an empty range (start == end) on expert E - 1."""
    eo = tl.arange(0, E_P2)
    ends = tl.load(offsets_ptr + eo, mask=eo < E, other=N).to(tl.int32)
    starts = tl.load(offsets_ptr + eo - 1, mask=(eo > 0) & (eo < E), other=0).to(tl.int32)
    n_tiles = tl.where(eo < E, (ends - starts + BLOCK - 1) // BLOCK, 0)
    cum = tl.cumsum(n_tiles, 0)  # inclusive
    e = tl.sum((cum <= pid).to(tl.int32), 0)  # tiles of experts before e: cum[e - 1] <= pid
    valid = e < E
    e = tl.minimum(e, E - 1)
    first = tl.sum(tl.where(eo < e, n_tiles, 0), 0)
    start = tl.sum(tl.where(eo == e, starts, 0), 0)
    end = tl.sum(tl.where(eo == e, ends, 0), 0)
    start = start + (pid - first) * BLOCK
    end = tl.where(valid, end, start)
    return e, start, end


# Where an operand's rows sit, for the tile's sorted positions r and their pairs p = order[r]
# (``_rows``; the modes' names: moeify.ops.moe.kernels.scatter_gemm.ROW, PAIR, SORTED): 0, the
# input rows p // K (x read through the sort; K = 1: the pairs in their own order); 1, the
# pairs' own order p; 2, expert order r itself (ScatterMoE's grouped_in / grouped_out: the
# expert MLP's hidden units).
@triton.jit
def _rows(MODE: tl.constexpr, r, p, K):
    """The rows of an operand for sorted positions ``r`` and their pairs ``p`` (ROW, PAIR or
    SORTED: 0, 1, 2, the comment above), int64."""
    if MODE == 2:  # SORTED
        rows = r.to(tl.int64)
    elif MODE == 1:  # PAIR
        rows = p
    else:  # ROW
        rows = p // K
    return rows


@triton.jit
def _fwd(x_ptr, w_ptr, y_ptr, order_ptr, offsets_ptr,
         N, D, F, K,
         sxm, sxd, swe, swd, swf,
         E: tl.constexpr, E_P2: tl.constexpr, PRECISION: tl.constexpr,
         X_ROWS: tl.constexpr, Y_ROWS: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr):
    n_f = tl.cdiv(F, BLOCK_F)
    pid = tl.program_id(0)  # the F tiles of one tile of pairs run side by side (L2 reuse)
    e, start, end = _tile(pid // n_f, offsets_ptr, N, E, E_P2, BLOCK_M)
    r = start + tl.arange(0, BLOCK_M)
    rmask = r < end
    p = tl.load(order_ptr + r, mask=rmask, other=0).to(tl.int64)  # pairs, unsorted index
    m = _rows(X_ROWS, r, p, K)  # the rows of x they read
    f = (pid % n_f) * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = f < F
    w_e = w_ptr + e.to(tl.int64) * swe
    acc = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dmask = d < D
        xa = tl.load(x_ptr + m[:, None] * sxm + d[None, :] * sxd,
                     mask=rmask[:, None] & dmask[None, :], other=0.0)
        wb = tl.load(w_e + d[:, None] * swd + f[None, :] * swf,
                     mask=dmask[:, None] & fmask[None, :], other=0.0)
        acc = tl.dot(xa, wb, acc, input_precision=PRECISION)
    omask = rmask[:, None] & fmask[None, :]
    offs = _rows(Y_ROWS, r, p, K)[:, None] * F + f[None, :]  # [N, F], contiguous
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=omask)

@triton.jit
def _bwd_x(grad_ptr, w_ptr, gx_ptr, order_ptr, offsets_ptr,
           N, D, F, K,
           sxm, sxd, swe, swd, swf,
           E: tl.constexpr, E_P2: tl.constexpr, ATOMIC: tl.constexpr,
           PRECISION: tl.constexpr, G_ROWS: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr):
    n_d = tl.cdiv(D, BLOCK_D)
    pid = tl.program_id(0)  # the D tiles of one tile of pairs side by side: grad rows from L2
    e, start, end = _tile(pid // n_d, offsets_ptr, N, E, E_P2, BLOCK_M)
    pid_d = pid % n_d
    r = start + tl.arange(0, BLOCK_M)
    rmask = r < end
    p = tl.load(order_ptr + r, mask=rmask, other=0).to(tl.int64)
    m = p // K
    pg = _rows(G_ROWS, r, p, K)  # the rows of the output gradient
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    w_e = w_ptr + e.to(tl.int64) * swe
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        fmask = f < F
        gr = tl.load(grad_ptr + pg[:, None] * F + f[None, :],
                     mask=rmask[:, None] & fmask[None, :], other=0.0)
        wt = tl.load(w_e + f[:, None] * swf + d[None, :] * swd,
                     mask=fmask[:, None] & dmask[None, :], other=0.0)
        acc = tl.dot(gr, wt, acc, input_precision=PRECISION)
    xmask = rmask[:, None] & dmask[None, :]
    offs = m[:, None] * sxm + d[None, :] * sxd
    if ATOMIC:
        tl.atomic_add(gx_ptr + offs, acc, mask=xmask, sem="relaxed")  # no ordering needed
    else:
        tl.store(gx_ptr + offs, acc.to(gx_ptr.dtype.element_ty), mask=xmask)

@triton.jit
def _bwd_w(x_ptr, grad_ptr, gw_ptr, order_ptr, offsets_ptr,
           N, D, F, K,
           sxm, sxd,
           E: tl.constexpr, E_P2: tl.constexpr, PRECISION: tl.constexpr, ITERS: tl.constexpr,
           X_ROWS: tl.constexpr, G_ROWS: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr):
    n_d = tl.cdiv(D, BLOCK_D)
    n_f = tl.cdiv(F, BLOCK_F)
    pid = tl.program_id(0)  # the (D, F) tiles of one chunk of pairs side by side
    e, start, end = _tile(pid // (n_d * n_f), offsets_ptr, N, E, E_P2, BLOCK_M * ITERS)
    pid_df = pid % (n_d * n_f)
    d = (pid_df // n_f) * BLOCK_D + tl.arange(0, BLOCK_D)
    f = (pid_df % n_f) * BLOCK_F + tl.arange(0, BLOCK_F)
    dmask = d < D
    fmask = f < F
    acc = tl.zeros((BLOCK_D, BLOCK_F), dtype=tl.float32)
    for i in range(ITERS):
        r = start + i * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = r < end
        p = tl.load(order_ptr + r, mask=rmask, other=0).to(tl.int64)
        m = _rows(X_ROWS, r, p, K)
        pg = _rows(G_ROWS, r, p, K)
        xt = tl.load(x_ptr + m[None, :] * sxm + d[:, None] * sxd,
                     mask=rmask[None, :] & dmask[:, None], other=0.0)
        gr = tl.load(grad_ptr + pg[:, None] * F + f[None, :],
                     mask=rmask[:, None] & fmask[None, :], other=0.0)
        acc = tl.dot(xt, gr, acc, input_precision=PRECISION)
    tl.atomic_add(gw_ptr + e.to(tl.int64) * D * F + d[:, None] * F + f[None, :], acc,
                  mask=(dmask & (start + tl.zeros_like(d) < end))[:, None] & fmask[None, :],
                  sem="relaxed")


def _cfg(bm, bd, bf, warps, stages, **extra):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_D=bd, BLOCK_F=bf, **extra),
                         num_warps=warps, num_stages=stages)


# GPU tilings for autotuning: a few sensible ones, from narrow F (SwitchHead's heads, F 64-128)
# to wide MLP experts. scripts/triton_compile_check.py compiles every one for Hopper (sm_90) and
# checks its shared memory. The last of each list tiles F by 16: SwitchHead 47M's head width 76,
# padded to 80, is five such tiles with nothing wasted, where a 64- or 128-wide tile computes
# 128 columns for 76 (or, for the input gradient, loops over F in five exact steps).
FWD_CONFIGS = [_cfg(64, 64, 64, 4, 3), _cfg(128, 64, 64, 4, 3), _cfg(128, 32, 128, 4, 3),
               _cfg(128, 64, 128, 8, 3), _cfg(64, 64, 128, 4, 4), _cfg(128, 128, 64, 8, 3),
               _cfg(128, 64, 16, 4, 4)]
BWD_X_CONFIGS = [_cfg(64, 64, 64, 4, 3), _cfg(128, 64, 64, 4, 3), _cfg(128, 128, 32, 8, 3),
                 _cfg(128, 128, 64, 8, 3), _cfg(64, 128, 64, 4, 3), _cfg(128, 64, 128, 8, 3),
                 _cfg(128, 128, 16, 8, 4)]
BWD_W_CONFIGS = [_cfg(64, 64, 64, 4, 3, ITERS=8), _cfg(64, 64, 128, 4, 3, ITERS=8),
                 _cfg(128, 64, 128, 8, 3, ITERS=4), _cfg(64, 128, 64, 8, 3, ITERS=8),
                 _cfg(64, 128, 128, 8, 3, ITERS=4), _cfg(32, 64, 64, 4, 4, ITERS=16),
                 _cfg(64, 128, 16, 4, 3, ITERS=8)]


# MOEIFY_TRITON_AUTOTUNE=0: one fixed configuration per kernel on a GPU too, the first of each
# list. Autotuning compiles and times every configuration of every kernel for each new (D, F, E):
# seconds per shape, which a training run pays once, but a test suite that tries dozens of
# shapes pays dozens of times (the GPU suite did not finish in 4 minutes with it).
AUTOTUNE = env_flag("MOEIFY_TRITON_AUTOTUNE", default=True)


def _fixed(configs) -> tuple[dict, dict]:
    """The first configuration's meta-parameters and its launch options (warps, stages)."""
    c = configs[0]
    return dict(c.kwargs), dict(num_warps=c.num_warps, num_stages=c.num_stages)


def build():
    """{name: (kernel, fixed meta-parameters)}: autotuned kernels on a GPU (one fixed
    configuration each with MOEIFY_TRITON_AUTOTUNE=0), one small fixed configuration in the
    interpreter."""
    if not INTERPRET and not AUTOTUNE:
        out = {}
        for name, kernel, configs in (("fwd", _fwd, FWD_CONFIGS), ("bwd_x", _bwd_x, BWD_X_CONFIGS),
                                      ("bwd_w", _bwd_w, BWD_W_CONFIGS)):
            meta, launch = _fixed(configs)
            out[name] = (kernel, {**meta, **launch})
        return dict(out, autotuned=False)
    if INTERPRET:
        # One small configuration: the interpreter is slow and tests use tiny shapes.
        fixed = dict(BLOCK_M=16, BLOCK_D=32, BLOCK_F=32)
        return dict(fwd=(_fwd, fixed), bwd_x=(_bwd_x, fixed), bwd_w=(_bwd_w, dict(fixed, ITERS=2)),
                    autotuned=False)

    # Keyed on the widths, the expert count and the variant (atomic or stores, where the rows
    # sit), not on N (which changes with every batch shape).
    key = ["D", "F", "E"]
    fwd = triton.autotune(FWD_CONFIGS, key=key + ["X_ROWS", "Y_ROWS"])(_fwd)
    # The atomically accumulated outputs are zeroed before every trial and the final run.
    bwd_x = triton.autotune(BWD_X_CONFIGS, key=key + ["ATOMIC", "G_ROWS"],
                            reset_to_zero=["gx_ptr"])(_bwd_x)
    bwd_w = triton.autotune(BWD_W_CONFIGS, key=key + ["X_ROWS", "G_ROWS"],
                            reset_to_zero=["gw_ptr"])(_bwd_w)
    return dict(fwd=(fwd, {}), bwd_x=(bwd_x, {}), bwd_w=(bwd_w, {}), autotuned=True)


