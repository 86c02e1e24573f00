"""The "triton" expert kernel: the gather and the scatter fused into the GEMM (Triton kernels).

Shape legend
    M  rows          K  experts per row       E  experts          N = M * K routed pairs
    D  input width   F  output width

The other kernels multiply rows gathered into expert order ([N, D] copies). Here the pairs
sorted by expert (``RoutingPlan.order_N`` / ``offsets_E``) are cut, per expert, into tiles of
BLOCK_M pairs, and each kernel program reads its rows of x *through the sort* (x[order // K])
straight from x, multiplies by w[e] with an fp32 accumulator and writes each result to its
unsorted place: the layout is the pairs in their own order (``pair_layout``), and nothing
[N, D] is ever materialised. The same idea as the SwitchHead authors' CVMM and ScatterMoE's
scatter2scatter, written afresh here. The gates, group and row sums are the shared combine's
(moeify.ops.moe.combine), on the narrow [N, F] products.

Kernels (moeify.ops.moe.kernels._triton_jit; one program = one tile of one expert's sorted
pairs times one tile of the output columns; the tile's expert and start are found inside the
kernel from ``offsets_E`` by a prefix sum over the experts, so the grid needs no host sync: it
is sized for the worst case, cdiv(N, BLOCK_M) + E tiles of pairs, and surplus programs do
nothing. The grid is flat, with the column tiles of one tile of pairs next to each other, so
the rows they share come from L2):

    _fwd      y[p] = x[p // K] @ w[e] for a tile of pairs x a tile of F, looping over D.
    _bwd_x    grad_x[p // K] += g[p] @ w[e]ᵀ for a tile of pairs x a tile of D, looping over F.
              The K pairs of a row lie in different experts' tiles, so the sum over them is an
              fp32 atomic add into an [M, D] buffer (cast to x's dtype after): a sorted
              segmented reduction would need the per-pair [N, D] products in memory, the very
              copy this kernel exists to avoid, and each address gets only K atomic adds. The
              fp32 summation order of those K terms is therefore not fixed (not bit-reproducible
              run to run). With K = 1 each row has one pair: a plain store, deterministic.
    _bwd_w    grad_w[e] += x[rows]ᵀ @ g[pairs] for a chunk of one expert's pairs (BLOCK_M x
              ITERS) x a (D, F) tile: chunks rather than whole experts keep every SM busy with
              few experts and with skewed routing; the chunks of one expert are summed with
              fp32 atomic adds into an [E, D, F] buffer.

Numerics: loads in the input dtype (fp32, fp16, bf16), products accumulated in fp32; fp32 dots
use ``input_precision="ieee"`` (no TF32).

Triton is optional: it is imported on first use (``triton_available``). On CPU the kernels run
only under Triton's interpreter (TRITON_INTERPRET=1 set before triton is first imported), which
is how the tests run them; on CUDA "auto" takes this kernel.
"""

from __future__ import annotations

import functools
import os

import torch

from moeify.errors import install_hint
from moeify.ops.moe.layout import pair_layout
from moeify.ops.moe.registry import ExpertKernel, register

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
    """Why the triton kernel cannot run on x here (what to do instead), or None."""
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


@functools.lru_cache(maxsize=None)
def _kernels():
    """The jitted kernels, imported on first use (triton is optional and slowish to import)."""
    from moeify.ops.moe.kernels import _triton_jit

    return _triton_jit.build()


def _launch(name, grid_fn, *args, **kwargs):
    kernel, fixed = _kernels()[name]
    if fixed:
        kernel[grid_fn(fixed)](*args, **kwargs, **fixed)
    else:
        kernel[grid_fn](*args, **kwargs)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _meta(x: torch.Tensor, E: int) -> dict:
    # fp32: true fp32 products (no TF32); fp16 / bf16 dots ignore the setting.
    return dict(E=E, E_P2=max(2, 1 << (E - 1).bit_length()),
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32")


class TritonKernel(ExpertKernel):
    name = "triton"
    gathers_rows = True

    def unavailable(self, x, w):
        return unavailable_reason(x)

    def layout(self, plan):
        return pair_layout(plan)

    def forward(self, a, w_EAB, lay, k=None):
        """[N, B]: pair p = a[p // k] @ w[e] (k None: a[p])."""
        a = a.contiguous()
        plan, K = lay.plan, k or 1
        E, A, B = w_EAB.shape
        N = plan.num_pairs
        y = a.new_empty(N, B)
        if N and B and A:
            _launch("fwd", lambda c: ((_cdiv(N, c["BLOCK_M"]) + E) * _cdiv(B, c["BLOCK_F"]),),
                    a, w_EAB, y, plan.order_N, plan.offsets_E, N, A, B, K, a.stride(0),
                    a.stride(1), *w_EAB.stride(), **_meta(a, E))
        elif N:
            y.zero_()
        return y

    def input_grad(self, g_PB, w_EAB, lay, k=None, n_rows=0):
        """[M, A]: row m sums g[p] @ w[e]ᵀ over its k pairs (k None: one row per pair)."""
        g = g_PB.contiguous()
        plan, K = lay.plan, k or 1
        E, A, B = w_EAB.shape
        N = plan.num_pairs
        M = n_rows if k else N
        atomic = K > 1
        # K = 1: every row's one pair stores its whole row (when there is any B to sum over).
        gx = (g.new_empty(M, A) if not atomic and B else
              torch.zeros(M, A, device=g.device, dtype=torch.float32 if atomic else g.dtype))
        if N and B and A:
            _launch("bwd_x", lambda c: ((_cdiv(N, c["BLOCK_M"]) + E) * _cdiv(A, c["BLOCK_D"]),),
                    g, w_EAB, gx, plan.order_N, plan.offsets_E, N, A, B, K, gx.stride(0),
                    gx.stride(1), *w_EAB.stride(), ATOMIC=atomic, **_meta(g, E))
        return gx.to(g.dtype)

    def weight_grad(self, a, g_PB, lay, n_experts, k=None):
        """[E, A, B]: Σ over each expert's pairs of a[p // k]ᵀ g[p]."""
        a, g = a.contiguous(), g_PB.contiguous()
        plan, K = lay.plan, k or 1
        A, B = a.shape[1], g.shape[1]
        N, E = plan.num_pairs, n_experts
        gw = torch.zeros(E, A, B, device=a.device, dtype=torch.float32)
        if N and A and B:
            _launch("bwd_w", lambda c: ((_cdiv(N, c["BLOCK_M"] * c["ITERS"]) + E)
                                        * _cdiv(A, c["BLOCK_D"]) * _cdiv(B, c["BLOCK_F"]),),
                    a, g, gw, plan.order_N, plan.offsets_E, N, A, B, K, a.stride(0),
                    a.stride(1), **_meta(a, E))
        return gw.to(a.dtype)


register(TritonKernel())
