"""The "triton" expert matmul: the gather and the scatter fused into the GEMM (Triton kernels).

Shape legend
    M  rows          K  experts per row       E  experts          N = M * K routed pairs
    D  input width   F  output width          G  output groups    R  rows summed per output
    O  output rows of the gated sum, M / R * G

Every layout in moeify.ops.expert_matmul gathers the input rows into expert order ([N, D]
copies, also kept for the backward), runs many small GEMMs and scatters back. Here the pairs
sorted by expert (``ExpertPlan.order_N`` / ``offsets_E``) are cut, per expert, into tiles of
BLOCK_M pairs, and each kernel program reads its rows of x *through the selection*
(x[order_N // K]) straight from x, multiplies by w[e] with an fp32 accumulator and writes each
result to its unsorted place. Nothing [N, D] is ever materialised, and only x (plus the narrow
[N, F] products when the gate gradient is needed) is saved for the backward. The same idea as
the SwitchHead authors' CVMM and ScatterMoE's scatter2scatter, written afresh here.

Kernels (one program = one tile of one expert's sorted pairs times one tile of the output
columns; the tile's expert and start are found inside the kernel from ``offsets_E`` by a prefix
sum over the experts, so the grid needs no host sync: it is sized for the worst case,
cdiv(N, BLOCK_M) + E tiles of pairs, and surplus programs do nothing. The grid is flat, with the
column tiles of one tile of pairs next to each other, so the rows they share come from L2; no
host sync anywhere, so the eager CUDA path never waits for the GPU):

    _fwd      y[p] = x[p // K] @ w[e] (times gate[p] when gated) for a tile of pairs x a tile of F,
              looping over D. Ungated it writes [N, F] = [M, K, F] directly. Gated it writes the
              gate-weighted per-pair products, and one torch sum over K (and R rows) makes
              [O, F]: F is narrow, so that [N, F] pass is cheap, and it is deterministic where a
              fused sum would need atomics. With ``save_ys`` the ungated products are also
              written ([N, F]) for the gate gradient.
    _bwd_x    grad_x[p // K] += (grad[out(p)] @ w[e]^T) * gate[p], the grad rows read through the
              selection (out(p) = the output row pair p was summed into: p itself ungated,
              (p // K // R) * G + (p % K) // (K / G) gated), for a tile of pairs x a tile of D,
              looping over F. The K pairs of a row lie in different experts' tiles, so the sum
              over them is an fp32 atomic add into an [M, D] buffer (cast to x's dtype after).
              Why atomics, not a sorted segmented reduction: the latter needs the per-pair
              [N, D] products in memory (the very copy this kernel exists to avoid) and a second
              pass over them; each address gets only K atomic adds, so contention is nil. The
              price is that the fp32 summation order of those K terms is not fixed (not
              bit-reproducible run to run). With K = 1 each row has one pair: a plain store,
              deterministic, into the x-dtype result. The program of the first D tile also
              computes the gate gradient, grad_gate[p] = <ys[p], grad[out(p)]>, from the saved
              narrow products while it streams the grad rows.
    _bwd_w    grad_w[e] += x[rows]^T @ (grad[out(rows)] * gate) for a chunk of one expert's
              pairs (BLOCK_M x ITERS) x a (D, F) tile: chunks rather than whole experts keep
              every SM busy with few experts and with skewed routing; the chunks of one expert
              are summed with fp32 atomic adds into an [E, D, F] buffer.

Numerics: loads in the input dtype (fp32, fp16, bf16), products accumulated in fp32; fp32 dots
use ``input_precision="ieee"`` (no TF32). Gates are applied in fp32.

Triton is optional: this module imports it on first use (``triton_available``). On CPU the
kernels run only under Triton's interpreter (TRITON_INTERPRET=1 set before triton is first
imported), which is how the tests run them; on CUDA "auto" takes this implementation.

torch.compile: the forward and the backward are registered ops (``moeify::triton_em_fwd`` /
``moeify::triton_em_bwd``, torch.library.custom_op with fake kernels and the forward's autograd
registered), so a compiled graph keeps them whole; eager calls take the plain autograd Function
(``TritonExpertMatmul``), which skips the dispatcher's overhead and runs the same launchers.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

from moeify.errors import install_hint
from moeify.ops.amp import amp_backward, amp_forward

# Dtypes the kernels take (float64 is not a tensor-core type; use another implementation).
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


_AVAILABLE: list[bool] = []


def triton_available() -> bool:
    """Whether triton can be imported (the optional extra ``triton``); checked once."""
    if not _AVAILABLE:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
            _AVAILABLE.append(True)
        except Exception:  # ImportError, or a broken install without a driver
            _AVAILABLE.append(False)
    return _AVAILABLE[0]


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(x: torch.Tensor) -> str | None:
    """Why the triton implementation cannot run on x here (what to do instead), or None."""
    if not triton_available():
        return (f'impl="triton" needs triton: {install_hint("triton")} (or pick another '
                'implementation, e.g. impl="auto")')
    if x.dtype not in DTYPES:
        return (f'impl="triton" runs float32, float16 and bfloat16, got {x.dtype}; use '
                'impl="reference" or "segment" for float64')
    if x.device.type == "cuda" or (x.device.type == "cpu" and interpreting()):
        return None
    return (f'impl="triton" runs on CUDA tensors, got device {x.device.type!r}; on the CPU '
            'it runs only in Triton\'s interpreter: set TRITON_INTERPRET=1 in the environment '
            'before anything imports triton (slow: for tests only), or choose another '
            'implementation (impl="auto")')


def check_runnable(x: torch.Tensor) -> None:
    """Raise ValueError saying what to do where the triton implementation cannot run on x."""
    reason = unavailable_reason(x)
    if reason is not None:
        raise ValueError(reason)


# ---------------------------------------------------------------------------------- kernels


@functools.lru_cache(maxsize=None)
def _kernels():
    """The jitted kernels, imported on first use (triton is optional and slowish to import)."""
    from moeify.ops import _triton_kernels

    return _triton_kernels.build()


def _launch(name, grid_fn, *args, **kwargs):
    kernel, fixed = _kernels()[name]
    if fixed:
        kernel[grid_fn(fixed)](*args, **kwargs, **fixed)
    else:
        kernel[grid_fn](*args, **kwargs)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _precision(dtype: torch.dtype) -> str:
    # fp32: true fp32 products (no TF32); fp16 / bf16 dots ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _e_p2(E: int) -> int:
    return max(2, 1 << (E - 1).bit_length())


# -------------------------------------------------------------------------------- launchers


def forward_impl(x_MD, w_EDF, gates_MK, order_N, offsets_E, k: int, groups: int, sum_rows: int,
                 save_ys: bool):
    """(y, ys): y is [N, F] ungated, else the gated sums [O, F] (O = M / R * G); ys the ungated
    per-pair products [N, F] when ``save_ys`` (the gate gradient needs them), else empty."""
    dev = x_MD.device.type if x_MD.device.type in ("cuda", "cpu") else "cpu"
    with torch.autocast(dev, enabled=False):
        x_MD = x_MD.contiguous()
        M, D = x_MD.shape
        E, _, Fo = w_EDF.shape
        N = M * k
        gated = gates_MK is not None
        y_NF = x_MD.new_empty(N, Fo)
        ys_NF = x_MD.new_empty(N if save_ys else 0, Fo)
        if N and Fo:
            g = gates_MK.reshape(-1).contiguous() if gated else y_NF
            _launch("fwd", lambda c: ((_cdiv(N, c["BLOCK_M"]) + E) * _cdiv(Fo, c["BLOCK_F"]),),
                    x_MD, w_EDF, y_NF, ys_NF if save_ys else y_NF, order_N, offsets_E, g,
                    N, D, Fo, k, x_MD.stride(0), x_MD.stride(1), *w_EDF.stride(),
                    E=E, E_P2=_e_p2(E), GATED=gated, SAVE_YS=save_ys,
                    PRECISION=_precision(x_MD.dtype))
        elif N:
            y_NF.zero_()
        if not gated:
            return y_NF, ys_NF
        y = y_NF.view(M // sum_rows, sum_rows, groups, k // groups, Fo).sum((1, 3))
        return y.reshape(M // sum_rows * groups, Fo), ys_NF


def backward_impl(grad_OF, x_MD, w_EDF, gates_MK, ys_NF, order_N, offsets_E, k: int,
                  groups: int, sum_rows: int, need_x: bool, need_w: bool, need_g: bool):
    """(grad_x, grad_w, grad_gates) for the output gradient ``grad_OF`` ([N, F] ungated, [O, F]
    gated); an input whose gradient is not needed gets an empty tensor."""
    dev = x_MD.device.type if x_MD.device.type in ("cuda", "cpu") else "cpu"
    with torch.autocast(dev, enabled=False):
        x_MD = x_MD.contiguous()
        # The autocast convention: the incoming gradient in the saved operands' dtype. Also
        # materialises stride-0 gradients (y.sum().backward()).
        grad_OF = grad_OF.to(x_MD.dtype).contiguous()
        M, D = x_MD.shape
        E, _, Fo = w_EDF.shape
        N = M * k
        gated = gates_MK is not None
        need_g = need_g and gated
        prec = _precision(x_MD.dtype)
        gates_N = gates_MK.reshape(-1).contiguous() if gated else grad_OF
        common = dict(E=E, E_P2=_e_p2(E), GATED=gated, PRECISION=prec)
        atomic = k > 1
        gx = gw = gg = None
        if need_x:
            # K = 1: every row's one pair stores its whole row (when there is any F to sum
            # over), so no zeroing is needed.
            gx = (x_MD.new_empty(M, D) if not atomic and Fo else
                  torch.zeros(M, D, device=x_MD.device,
                              dtype=torch.float32 if atomic else x_MD.dtype))
        if need_g:
            gg = torch.zeros(N, device=x_MD.device, dtype=torch.float32)
        # Never the output gradient as a stand-in pointer: autotuning zeroes the gx argument.
        dummy = torch.empty(1, device=x_MD.device, dtype=torch.float32)
        if (need_x or need_g) and N and Fo and D:
            _launch("bwd_x", lambda c: ((_cdiv(N, c["BLOCK_M"]) + E) * _cdiv(D, c["BLOCK_D"]),),
                    grad_OF, w_EDF, x_MD, ys_NF if need_g else grad_OF,
                    gx if need_x else dummy, gg if need_g else dummy,
                    order_N, offsets_E, gates_N,
                    N, D, Fo, k, k // groups, groups, sum_rows,
                    x_MD.stride(0), x_MD.stride(1), *w_EDF.stride(),
                    NEED_GX=need_x, NEED_GG=need_g, ATOMIC=atomic, **common)
        if need_w:
            gw = torch.zeros(E, D, Fo, device=x_MD.device, dtype=torch.float32)
            if N and Fo and D:
                _launch("bwd_w", lambda c: ((_cdiv(N, c["BLOCK_M"] * c["ITERS"]) + E)
                                            * _cdiv(D, c["BLOCK_D"]) * _cdiv(Fo, c["BLOCK_F"]),),
                        x_MD, grad_OF, gw, order_N, offsets_E, gates_N,
                        N, D, Fo, k, k // groups, groups, sum_rows,
                        x_MD.stride(0), x_MD.stride(1), **common)
        # Distinct empty tensors: a registered op's outputs must not alias each other.
        gx = gx.to(x_MD.dtype) if need_x else x_MD.new_empty(0)
        gw = gw.to(w_EDF.dtype) if need_w else x_MD.new_empty(0)
        gg = gg.view(M, k).to(gates_MK.dtype) if need_g else x_MD.new_empty(0)
        return gx, gw, gg


class TritonExpertMatmul(torch.autograd.Function):
    """The fused expert matmul (module docstring). Returns [N, F] ungated, [O, F] gated."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_MD, w_EDF, gates_MK, order_N, offsets_E, k, groups, sum_rows):
        save_ys = gates_MK is not None and gates_MK.requires_grad
        y, ys_NF = forward_impl(x_MD, w_EDF, gates_MK, order_N, offsets_E, k, groups, sum_rows,
                                save_ys)
        ctx.save_for_backward(x_MD, w_EDF, gates_MK, ys_NF, order_N, offsets_E)
        ctx.meta = (k, groups, sum_rows)
        return y

    @staticmethod
    @amp_backward
    def backward(ctx, grad):
        x_MD, w_EDF, gates_MK, ys_NF, order_N, offsets_E = ctx.saved_tensors
        need_x, need_w, need_g = ctx.needs_input_grad[:3]
        gx, gw, gg = backward_impl(grad, x_MD, w_EDF, gates_MK, ys_NF, order_N, offsets_E,
                                   *ctx.meta, need_x, need_w, need_g and gates_MK is not None)
        return (gx if need_x else None, gw if need_w else None,
                gg if need_g and gates_MK is not None else None, None, None, None, None, None)


# ------------------------------------------------------------------------- torch.compile ops


def _register_ops():
    """The registered ops, at import (dynamo cannot trace their registration); no triton needed
    until they run."""

    @torch.library.custom_op("moeify::triton_em_fwd", mutates_args=())
    def em_fwd(x: Tensor, w: Tensor, gates: Optional[Tensor], order: Tensor, offsets: Tensor,
               k: int, groups: int, sum_rows: int, save_ys: bool) -> tuple[Tensor, Tensor]:
        return forward_impl(x, w, gates, order, offsets, k, groups, sum_rows, save_ys)

    @em_fwd.register_fake
    def _(x, w, gates, order, offsets, k, groups, sum_rows, save_ys):
        M, Fo = x.shape[0], w.shape[-1]
        rows = M * k if gates is None else M // sum_rows * groups
        return x.new_empty(rows, Fo), x.new_empty(M * k if save_ys else 0, Fo)

    @torch.library.custom_op("moeify::triton_em_bwd", mutates_args=())
    def em_bwd(grad: Tensor, x: Tensor, w: Tensor, gates: Optional[Tensor], ys: Tensor,
               order: Tensor, offsets: Tensor, k: int, groups: int, sum_rows: int,
               need_x: bool, need_w: bool, need_g: bool) -> tuple[Tensor, Tensor, Tensor]:
        return backward_impl(grad, x, w, gates, ys, order, offsets, k, groups, sum_rows,
                             need_x, need_w, need_g)

    @em_bwd.register_fake
    def _(grad, x, w, gates, ys, order, offsets, k, groups, sum_rows, need_x, need_w, need_g):
        return (x.new_empty(x.shape if need_x else (0,)),
                w.new_empty(w.shape if need_w else (0,)),
                (gates.new_empty(gates.shape) if need_g and gates is not None
                 else x.new_empty(0)))

    def setup_context(ctx, inputs, output):
        x, w, gates, order, offsets, k, groups, sum_rows, save_ys = inputs
        ctx.save_for_backward(x, w, gates, output[1], order, offsets)
        ctx.meta = (k, groups, sum_rows)

    def backward(ctx, grad, _grad_ys):
        x, w, gates, ys, order, offsets = ctx.saved_tensors
        need_x, need_w, need_g = ctx.needs_input_grad[:3]
        need_g = need_g and gates is not None
        gx, gw, gg = em_bwd(grad, x, w, gates, ys, order, offsets, *ctx.meta,
                            need_x, need_w, need_g)
        return (gx if need_x else None, gw if need_w else None, gg if need_g else None,
                None, None, None, None, None, None)

    em_fwd.register_autograd(backward, setup_context=setup_context)
    return em_fwd, em_bwd


_em_fwd, _em_bwd = _register_ops()


def triton_expert_matmul(x_MD, w_EDF, gates_MK, plan, k: int, groups: int, sum_rows: int):
    """The fused expert matmul of ``plan``'s routing: [M, K, F] ungated, the gated sums [M / R,
    F] (groups = 1) or [M, G, F]. Inputs are validated by expert_matmul; ``check_runnable``
    says whether this machine can run it."""
    M, Fo = x_MD.shape[0], w_EDF.shape[-1]
    order, offsets = plan.order_N, plan.offsets_E
    if torch.compiler.is_compiling():
        save_ys = gates_MK is not None and gates_MK.requires_grad
        y = _em_fwd(x_MD, w_EDF, gates_MK, order, offsets, k, groups, sum_rows, save_ys)[0]
    else:
        y = TritonExpertMatmul.apply(x_MD, w_EDF, gates_MK, order, offsets, k, groups, sum_rows)
    if gates_MK is None:
        return y.view(M, k, Fo)
    return y.view(M, groups, Fo) if groups > 1 else y
