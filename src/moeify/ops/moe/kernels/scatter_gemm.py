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

Each kernel reads and writes its row operands at rows chosen per operand (``ROW``: the input
rows p // K; ``PAIR``: the pairs' own order; ``SORTED``: expert order, the tile's sorted
positions themselves). The expert matmul uses x at ``ROW`` and its products at ``PAIR``. The
expert MLP (``sorted_mlp``, moeify.ops.moe.mlp) keeps its hidden units in expert order between
its two matmuls, as ScatterMoE does (arXiv 2403.08245: its ParallelLinear's grouped_out for the
first, grouped_in for the second): h = x[p // K] @ w1[e] written at ``SORTED``, relu in place,
then read at ``SORTED`` by the second matmul, which writes pair order for the gated sum of a
row's K pairs. The backward stays in expert order too: ga = g[p // K] @ w2[e]ᵀ written at
``SORTED``, dW2 from (gate · a) at ``SORTED`` and g at ``ROW``, dW1 from x at ``ROW`` and dh at
``SORTED``, dx summed from dh at ``SORTED``. Through two expert matmuls instead (the composite),
the hidden units are written in pair order and read back through the sort, in the forward and
again in the backward: scattered rows where these are contiguous.

Numerics: loads in the input dtype (fp32, fp16, bf16), products accumulated in fp32; fp32 dots
use ``input_precision="ieee"`` (no TF32).

Aligned widths. Triton compiles a kernel for the arguments it is launched with, and marks an
integer argument divisible by 16 only when it is: a row stride or width of 412 or 76 (SwitchHead
47M's D and F) gets no mark, so the compiler cannot prove any row aligned and falls back to one
2-byte load per element, with no asynchronous copies into shared memory and scalar atomics
(the PTX for sm_90 shows it: ``ld.global.b16`` where an aligned launch gets 16-byte
``cp.async`` copies pipelined over ``num_stages`` and ``red.global...v4.f32`` atomics;
tests/ops/test_triton_matmul.py and scripts/triton_compile_check.py check both). So each entry
point pads every width the kernels see to a multiple of ``ALIGN`` = 16 elements with zeros:
x's columns ([M, D] -> [M, D16]: a copy of x in the forward and another for the weight
gradient, never an [N, D] one), w to [E, D16, F16], the pairs' output gradient to [N, F16];
the padded products are exact zeros, and results are
sliced back to D and F (copied, so that every output stays contiguous). ``MOEIFY_TRITON_PAD=0``
turns the padding off (to measure it).

Triton is optional: it is imported on first use (``triton_available``). On CPU the kernels run
only under Triton's interpreter (TRITON_INTERPRET=1 set before triton is first imported), which
is how the tests run them; on CUDA "auto" takes this kernel.
"""

from __future__ import annotations

import functools
import os

import torch

from moeify.errors import env_flag, install_hint
from moeify.ops.amp import amp_backward, amp_forward
from moeify.ops.moe.layout import pair_layout, row_dot, slot_sums
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


# Triton specialises an integer argument as divisible by 16 (elements) when it is; rows and
# widths padded to this are 16-byte aligned in every dtype the kernels take.
ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN if env_flag("MOEIFY_TRITON_PAD", default=True) else n


def _pad(t: torch.Tensor, *widths: int) -> torch.Tensor:
    """t, contiguous, with its trailing dimensions zero-padded to ``widths``."""
    extra = [w - n for w, n in zip(widths, t.shape[t.dim() - len(widths):])]
    if not any(extra):
        return t.contiguous()
    pads = []
    for e in reversed(extra):  # F.pad takes the last dimension first
        pads += [0, e]
    return torch.nn.functional.pad(t, pads)


def _meta(x: torch.Tensor, E: int) -> dict:
    # fp32: true fp32 products (no TF32); fp16 / bf16 dots ignore the setting.
    return dict(E=E, E_P2=max(2, 1 << (E - 1).bit_length()),
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32")


# Where an operand's rows sit, for a tile's sorted positions r and their pairs p = order[r]
# (the kernels' X_ROWS / Y_ROWS / G_ROWS, moeify.ops.moe.kernels._triton_jit): the input rows
# p // K, the pairs' own order p, expert order r.
ROW, PAIR, SORTED = 0, 1, 2


def _forward(a, w_EAB, plan, K: int, a_rows: int = ROW, y_rows: int = PAIR) -> torch.Tensor:
    """[N, B]: sorted position r (pair p = order[r], expert e) gives a[rows] @ w[e], read at
    the rows ``a_rows`` says (ROW: p // K; SORTED: r) and written at ``y_rows`` (PAIR: p;
    SORTED: r)."""
    E, A, B = w_EAB.shape
    N = plan.num_pairs
    if not (N and B and A):
        return a.new_zeros(N, B)
    Ap, Bp = _aligned(A), _aligned(B)
    a, w = _pad(a, Ap), _pad(w_EAB, Ap, Bp)
    y = a.new_empty(N, Bp)
    _launch("fwd", lambda c: ((_cdiv(N, c["BLOCK_M"]) + E) * _cdiv(Bp, c["BLOCK_F"]),),
            a, w, y, plan.order_N, plan.offsets_E, N, Ap, Bp, K, a.stride(0), a.stride(1),
            *w.stride(), X_ROWS=a_rows, Y_ROWS=y_rows, **_meta(a, E))
    # Contiguous, as every kernel's output (and the compiled op's fake) is: one [N, F] copy.
    return y if Bp == B else y[:, :B].contiguous()


def _input_grad(g, w_EAB, plan, K: int, n_rows: int, g_rows: int = PAIR) -> torch.Tensor:
    """[n_rows, A]: input row m sums g[rows] @ w[e]ᵀ over its pairs p (m = p // K), the
    gradient read at ``g_rows`` (PAIR: p; SORTED: the pair's sorted position)."""
    E, A, B = w_EAB.shape
    N = plan.num_pairs
    if not (N and B and A):
        return g.new_zeros(n_rows, A)
    atomic = K > 1
    Ap, Bp = _aligned(A), _aligned(B)
    g, w = _pad(g, Bp), _pad(w_EAB, Ap, Bp)
    # K = 1: every row's one pair stores its whole row.
    gx = (g.new_empty(n_rows, Ap) if not atomic else
          torch.zeros(n_rows, Ap, device=g.device, dtype=torch.float32))
    _launch("bwd_x", lambda c: ((_cdiv(N, c["BLOCK_M"]) + E) * _cdiv(Ap, c["BLOCK_D"]),),
            g, w, gx, plan.order_N, plan.offsets_E, N, Ap, Bp, K, gx.stride(0),
            gx.stride(1), *w.stride(), ATOMIC=atomic, G_ROWS=g_rows, **_meta(g, E))
    return gx[:, :A].to(g.dtype).contiguous()


def _weight_grad(a, g, plan, K: int, E: int, a_rows: int = ROW,
                 g_rows: int = PAIR) -> torch.Tensor:
    """[E, A, B]: Σ over each expert's pairs of a[rows]ᵀ g[rows], each read at the rows its
    mode says (ROW: p // K; PAIR: p; SORTED: the sorted position)."""
    A, B = a.shape[1], g.shape[1]
    N = plan.num_pairs
    if not (N and A and B):
        return a.new_zeros(E, A, B)
    Ap, Bp = _aligned(A), _aligned(B)
    a, g = _pad(a, Ap), _pad(g, Bp)
    gw = torch.zeros(E, Ap, Bp, device=a.device, dtype=torch.float32)
    _launch("bwd_w", lambda c: ((_cdiv(N, c["BLOCK_M"] * c["ITERS"]) + E)
                                * _cdiv(Ap, c["BLOCK_D"]) * _cdiv(Bp, c["BLOCK_F"]),),
            a, g, gw, plan.order_N, plan.offsets_E, N, Ap, Bp, K, a.stride(0), a.stride(1),
            X_ROWS=a_rows, G_ROWS=g_rows, **_meta(a, E))
    return gw[:, :A, :B].to(a.dtype).contiguous()


class _GroupedMLP(torch.autograd.Function):
    """y [M, D] = Σ_k gate · relu(x[m] @ w1[e]) @ w2[e] (moeify.ops.moe.mlp) with the hidden
    units in expert order between the two matmuls (module docstring); inputs validated, one
    dtype, ``k`` experts per row."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_MD, w1_EDG, w2_EGD, gates_MK, plan, k):
        gate_N = gates_MK.reshape(-1).to(x_MD.dtype)
        a_SG = torch.relu_(_forward(x_MD, w1_EDG, plan, k, ROW, SORTED))  # grouped_out
        y_ND = _forward(a_SG, w2_EGD, plan, 1, SORTED, PAIR)  # grouped_in, scattered to pairs
        y = slot_sums(y_ND, pair_layout(plan).slot_N, gate_N, k)
        ctx.save_for_backward(x_MD, w1_EDG, w2_EGD, gate_N, a_SG)
        ctx.meta = (plan, k, gates_MK.dtype, gates_MK.shape)
        return y

    @staticmethod
    @amp_backward
    def backward(ctx, grad_y):
        x_MD, w1_EDG, w2_EGD, gate_N, a_SG = ctx.saved_tensors
        plan, k, gate_dtype, gate_shape = ctx.meta
        need_x, need_w1, need_w2, need_g = ctx.needs_input_grad[:4]
        E, M = w1_EDG.shape[0], x_MD.shape[0]
        grad_x = grad_w1 = grad_w2 = grad_gates = None
        g_MD = grad_y.to(x_MD.dtype).contiguous()  # contiguous: stride-0 gradients
        gate_S = gate_N.index_select(0, plan.order_N)[:, None]  # the gates in expert order
        # ga = g W2ᵀ per pair, read through the sort and written in expert order.
        ga_SG = _forward(g_MD, w2_EGD.transpose(1, 2), plan, k, ROW, SORTED)
        if need_w2:
            grad_w2 = _weight_grad(a_SG * gate_S, g_MD, plan, k, E, SORTED, ROW)
        if need_g:  # d/dgate = ga · a, a dot over G, back in pair order
            grad_gates = row_dot(ga_SG, a_SG).index_select(0, plan.inverse_N)
            grad_gates = grad_gates.view(gate_shape).to(gate_dtype)
        # dh = gate · ga where the unit was active (a > 0 exactly where x W1 > 0).
        dh_SG = torch.ops.aten.threshold_backward(ga_SG.mul_(gate_S), a_SG, 0)
        del ga_SG
        if need_w1:
            grad_w1 = _weight_grad(x_MD, dh_SG, plan, k, E, ROW, SORTED)
        if need_x:
            grad_x = _input_grad(dh_SG, w1_EDG, plan, k, M, SORTED)
        return grad_x, grad_w1, grad_w2, grad_gates, None, None


class TritonKernel(ExpertKernel):
    name = "triton"
    gathers_rows = True

    def unavailable(self, x, w):
        return unavailable_reason(x)

    def layout(self, plan):
        return pair_layout(plan)

    def forward(self, a, w_EAB, lay, k=None):
        """[N, B]: pair p = a[p // k] @ w[e] (k None: a[p])."""
        return _forward(a, w_EAB, lay.plan, k or 1)

    def input_grad(self, g_PB, w_EAB, lay, k=None, n_rows=0):
        """[M, A]: row m sums g[p] @ w[e]ᵀ over its k pairs (k None: one row per pair)."""
        return _input_grad(g_PB, w_EAB, lay.plan, k or 1, n_rows if k else lay.plan.num_pairs)

    def weight_grad(self, a, g_PB, lay, n_experts, k=None):
        """[E, A, B]: Σ over each expert's pairs of a[p // k]ᵀ g[p]."""
        return _weight_grad(a, g_PB, lay.plan, k or 1, n_experts)

    def sorted_mlp(self, x_MD, w1_EDG, w2_EGD, gates_MK, plan, k):
        """The ReLU expert MLP with its hidden units in expert order (module docstring)."""
        return _GroupedMLP.apply(x_MD, w1_EDG, w2_EGD, gates_MK, plan, k)


register(TritonKernel())
