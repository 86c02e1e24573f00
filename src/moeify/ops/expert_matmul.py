"""The expert matmul: every row times the weight matrices of the experts it was routed to.

This is the one primitive every Mixture-of-Experts layer in moeify shares (SwitchHead's value,
output, query and key experts, MoA's query/output experts, sigma-MoE and Switch feedforwards).
The SwitchHead authors call it CVMM; MegaBlocks and torchtitan call it grouped GEMM.

Shape legend
    M  rows                  K  experts per row            E  experts
    D  input width           F  output width               N  = M * K routed (row, expert) pairs
    G  output groups (gate-weighted sums over K in G equal consecutive groups)

Given x_MD, idx_MK (ids in [0, E)), w_EDF and optional gates_MK:
    without gates:  y[m, k]    = x[m] @ w[idx[m, k]]                                  -> [M, K, F]
    with gates:     y[m]       = sum_k gates[m, k] * x[m] @ w[idx[m, k]]              -> [M, F]
    with gates and groups=G:   y[m, g] = sum over k in group g of the same            -> [M, G, F]
    with gates and sum_rows=R: y[m] = sum over the R rows m·R + r and all k of the same -> [M/R, F]
                               (SwitchHead's output experts: rows (token, head), one sum per token)

Implementations (``impl=``):
    "reference"  dense and obviously correct: x @ w for every expert, then pick; float64-safe.
    "gather"     per-row gathered batched matmul, w[idx] -> [N, D, F]; the naive baseline.
    "pairs"      one small matmul per routed (row, expert) pair against a view of that expert's
                 matrix: reads only the routed matrices and copies none; for a handful of pairs
                 (decoding at batch 1).
    "all"        every row through every expert in one batched matmul, then the routed products
                 picked: E/K times the multiply-adds, but each expert's matrix is read once and
                 nothing is copied or sorted; for a handful of rows (batched decoding).
    "segment"    rows sorted by expert once (an ExpertPlan), one torch.mm per expert segment.
    "grouped"    the same sorted layout through torch.nn.functional.grouped_mm.
    "padded"     the sorted rows cut into equal blocks of one expert each (padding the last) and
                 multiplied by one torch.bmm (moeify.ops.padded_matmul).
    "sets"       gated only, for plans whose experts come in groups (``make_plan(...,
                 group_size=E)``): a row's K experts of one group are one unit, units sorted by
                 their expert set and multiplied by the set's K matrices side by side
                 (moeify.ops.set_matmul).
    "triton"     fused Triton kernels (moeify.ops.triton_matmul): rows read through the sorted
                 selection inside the GEMM and results written to their unsorted place, no
                 [N, D] copy made or kept; CUDA (optional extra triton), or the CPU only
                 under Triton's interpreter (TRITON_INTERPRET=1, for tests).
    "auto"       the fastest correct one for the device, dtype, shapes and routing, decided in
                 one place for every layer (``choose_impl``); on CPU "pairs" or "all" for a
                 handful of pairs or rows (decoding), then "sets" where
                 ``sets_eligible`` holds, else "padded" when ``padding_pays`` (several threads;
                 single-threaded only when the padding is nearly free), else "segment".
While a profiler records, each call runs inside a range named ``TRACE_PREFIX`` + the
implementation, so that a benchmark can report what really ran
(``moeify.bench.timing.expert_impls_run``); without one no range is opened (it costs about 10 us,
a tenth of a decoding step's expert matmul).

Under torch.compile "auto" takes a layout without host syncs (``compiled_impl``): the per-expert
loop, the padded grid and the set layout size their work from the routing counts on the host
(``.tolist()`` / ``int()``), which would break the compiled graph at every expert matmul. On CPU
(and on CUDA outside bf16) that is "reference", one dense matmul over all experts, E/K times the
multiply-adds of the routed ones but no gathered weight copies (what "gather" would make:
[N, D, F]); with bf16 on CUDA it is torch's grouped GEMM, traced as a plain differentiable op
(``_grouped_traced``); on CUDA with triton installed it is "triton" first, whose kernels
are registered ops (torch.library) that the graph keeps whole. Explicitly chosen
implementations are kept as they are.

"segment" and "grouped" share one custom autograd Function: the forward gathers rows into
expert order, multiplies per expert and gathers the results back (no index_put, no scatter);
gates are applied to the narrow [N, F] product, never to [N, D] inputs. The backward computes
grad_x with one index_add over the sorted rows and grad_w per expert.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from moeify.ops.amp import amp_backward, amp_forward, autocast_cast, autocast_off
from moeify.ops.padded_matmul import PaddedExpertMatmul, padded_layout, padding_pays
from moeify.ops.planless_matmul import PLANLESS_FNS, combine, sum_rows_
from moeify.ops.routing import count_ids
from moeify.ops.set_matmul import SetExpertMatmul, head_major_order, set_layout, sets_eligible
from moeify.ops import triton_matmul

IMPLEMENTATIONS = ("reference", "gather", "pairs", "all", "segment", "grouped", "padded", "sets",
                   "triton")
# Profiler range of every expert matmul: TRACE_PREFIX + the implementation that ran.
TRACE_PREFIX = "moeify.expert_matmul."
# Decoding on CPU, where reading the weights from memory is the cost (measured at the 47M
# SwitchHead value experts, E = 10 matrices of 412 x 76, one thread, weights not in cache,
# microseconds per call; pairs = the per-pair mm loop by itself (the one autograd runs; under
# no_grad each pair is one addmm into its output row), the whole call adding about 40;
# sorted = the best of segment / padded):
#     rows (pairs)   pairs   gather   all   sorted
#     1 (4)            82     111     192    210
#     2 (8)           124     145     210    234
#     8 (32)          347     312     276    362
# "auto" takes "pairs" for at most as many pairs as there are experts (and PAIRS_MAX), else
# "all" for at most ALL_MAX_ROWS rows while that costs at most ALL_MAX_MACS multiply-adds
# (rows x E x D x F).
PAIRS_MAX = 16
ALL_MAX_ROWS = 32
ALL_MAX_MACS = 1 << 26
# "auto" on CPU keeps one GEMM per expert (no padding) once the average expert's GEMM has this
# many multiply-adds: a parallel region's start-up is then negligible and padding is pure waste.
# Measured (process CPU time of sigma-MoE fwd+bwd, 4096 tokens, d 512, E 8, k 2, G 384: 2e8 MACs
# per expert): segment 1.19x, padded 1.28x the equal-MAC dense MLP.
SEGMENT_MIN_MACS = 1 << 26
_HAS_GROUPED_MM = hasattr(F, "grouped_mm")
# The implementations that need no ExpertPlan (callers skip building one for them).
PLANLESS = tuple(PLANLESS_FNS)  # reference, gather, pairs, all (ops/planless_matmul.py)


def trace(kind: str):
    """The profiler range ``TRACE_PREFIX + kind`` while a profiler records, else nothing."""
    if torch.compiler.is_compiling() or not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"{TRACE_PREFIX}{kind}")


class ExpertPlan:
    """Routed pairs sorted by expert. Build once per routing with ``make_plan``; reuse it for every
    expert matmul that shares the routing (e.g. SwitchHead's Q and O experts, or V and O with a
    shared selection), also when those matmuls view the same ids with different row groupings.

    The pairs are the flattened ids, idx.reshape(-1); ``order_N`` lists pair indices in expert
    order (stable, so ties keep row order) and ``inverse_N`` maps a pair back to its sorted
    position; ``counts_E`` [E] (int64) counts the pairs per expert and ``offsets_E`` (int32) is its
    cumulative sum. Each is computed on first use and kept, as are the layouts derived from them
    (the padded grid, the set layout): a matmul that sorts by expert sets never pays for the sort
    by expert.

    ``group_size``: the experts come in groups of that many consecutive ids, and a row's experts
    of one group form a set (SwitchHead: the E experts of each head); enables "sets". None: no
    groups.
    """

    def __init__(self, flat_N: torch.Tensor, num_experts: int, group_size: int | None = None):
        self.num_experts = num_experts
        self.group_size = group_size
        self.flat_N = flat_N  # int64 [N]: the expert of each pair
        self._cache: dict = {}

    def _get(self, key, fn):
        v = self._cache.get(key)
        if v is None:
            v = self._cache[key] = fn()
        return v

    @property
    def num_pairs(self) -> int:
        return self.flat_N.shape[0]

    @property
    def order_N(self) -> torch.Tensor:
        return self._get("order", lambda: torch.argsort(self.flat_N, stable=True))

    @property
    def inverse_N(self) -> torch.Tensor:
        def inverse():
            order = self.order_N
            return torch.empty_like(order).index_copy_(
                0, order, torch.arange(order.numel(), device=order.device))
        return self._get("inverse", inverse)

    @property
    def counts_E(self) -> torch.Tensor:
        return self._get("counts", lambda: count_ids(self.flat_N, self.num_experts))

    @property
    def offsets_E(self) -> torch.Tensor:
        return self._get("offsets", lambda: torch.cumsum(self.counts_E, 0).to(torch.int32))


def _check_ids(idx: torch.Tensor, num_experts: int) -> None:
    if idx.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise ValueError(f"expert ids must be an integer tensor, got dtype {idx.dtype}")
    compiling = torch.compiler.is_compiling()
    if not compiling and idx.numel() == 0:  # compiled, numel may be an unbacked symbol
        return                              # (expert parallelism): the assertion takes 0 ids
    if idx.device.type == "cpu" and not compiling:
        if idx.numel() <= 64:  # decoding: one host copy instead of two reductions
            vals = idx.reshape(-1).tolist()
            lo, hi = min(vals), max(vals)
        else:
            lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(
                f"expert ids must lie in [0, {num_experts}), got values in [{lo}, {hi}]; "
                f"check the number of experts the weights were built with"
            )
    else:
        # No host sync on accelerators: a device-side assertion fires asynchronously instead.
        torch._assert_async(((idx >= 0) & (idx < num_experts)).all(), "expert id out of range")


def make_plan(idx: torch.Tensor, num_experts: int, *, group_size: int | None = None,
              in_range: bool = False) -> ExpertPlan:
    """The routing of ``idx`` (any shape; flattened) as an ExpertPlan, sorted by expert on first
    use. ``group_size``: the experts form groups of that many consecutive ids (see
    ``ExpertPlan``). ``in_range``: the caller built the ids in [0, num_experts) itself (a
    top-k over that many scores, plus group offsets), so the range check is skipped (it reads
    every id back to the host)."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if group_size is not None and (group_size < 1 or num_experts % group_size):
        raise ValueError(f"group_size={group_size} must be a positive divisor of "
                         f"num_experts={num_experts}")
    if not in_range:
        _check_ids(idx, num_experts)
    return ExpertPlan(idx.reshape(-1).to(torch.int64), num_experts, group_size)


# ----------------------------------------------------------------------------------------------
# Per-expert matmuls over rows already sorted by expert.


def _segment_mm(a_ND: torch.Tensor, b_EDF: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out = a_ND.new_empty(a_ND.shape[0], b_EDF.shape[-1])
    start = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(a_ND[start : start + c], b_EDF[e], out=out[start : start + c])
        start += c
    return out


def _segment_weight_grad(a_ND: torch.Tensor, g_NF: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out = a_ND.new_zeros(len(counts), a_ND.shape[1], g_NF.shape[1])
    start = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(a_ND[start : start + c].t(), g_NF[start : start + c], out=out[e])
        start += c
    return out


def _grouped_ok(*tensors: torch.Tensor) -> bool:
    """grouped_mm's preconditions: no float64, row strides multiples of 16 bytes."""
    for t in tensors:
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        if (t.shape[-1] * t.element_size()) % 16:
            return False
    return True


def _plan_counts(plan: ExpertPlan) -> list[int]:
    return plan.counts_E.tolist()  # one host sync per call; free on CPU


def _sorted_mm(kind: str, a_ND, b_EDF, plan: ExpertPlan) -> torch.Tensor:
    if kind == "grouped":
        return F.grouped_mm(a_ND.contiguous(), b_EDF, offs=plan.offsets_E)
    return _segment_mm(a_ND, b_EDF, _plan_counts(plan))


def _sorted_weight_grad(kind: str, a_ND, g_NF, plan: ExpertPlan) -> torch.Tensor:
    if kind == "grouped":
        return F.grouped_mm(a_ND.t(), g_NF.contiguous(), offs=plan.offsets_E)
    return _segment_weight_grad(a_ND, g_NF, _plan_counts(plan))


class _SortedExpertMatmul(torch.autograd.Function):
    """y = sorted-dispatch expert matmul (see module docstring). Inputs are pre-validated."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_MD, w_EDF, gates_MK, order_N, inverse_N, rows_N, plan, kind, k, groups):
        M, D = x_MD.shape
        N, Fo = order_N.shape[0], w_EDF.shape[-1]
        xs_ND = x_MD.index_select(0, rows_N)
        ys_NF = _sorted_mm(kind, xs_ND, w_EDF, plan)
        if gates_MK is not None:
            g_N = gates_MK.reshape(-1).index_select(0, order_N).to(ys_NF.dtype)
            y_NF = (ys_NF * g_N[:, None]).index_select(0, inverse_N)
            y = y_NF.view(M, groups, k // groups, Fo).sum(2)
            y = y.squeeze(1) if groups == 1 else y
        else:
            g_N = None
            y = ys_NF.index_select(0, inverse_N).view(M, k, Fo)
        ctx.save_for_backward(xs_ND, w_EDF, ys_NF if gates_MK is not None else None, g_N,
                              order_N, inverse_N, rows_N)
        ctx.meta = (plan, kind, M, k, groups, N, gates_MK is not None,
                    gates_MK.dtype if gates_MK is not None else None)
        return y

    @staticmethod
    @amp_backward
    def backward(ctx, grad_y):
        xs_ND, w_EDF, ys_NF, g_N, order_N, inverse_N, rows_N = ctx.saved_tensors
        plan, kind, M, k, groups, N, gated, gate_dtype = ctx.meta
        # .contiguous() also materialises stride-0 gradients (y.sum().backward()), which
        # grouped_mm's own backward cannot take.
        grad_y = grad_y.contiguous()
        D, Fo = w_EDF.shape[1:]
        grad_gates = None
        if gated:
            # Every pair of a group receives that group's output gradient.
            per_pair = grad_y.view(M, groups, 1, Fo).expand(M, groups, k // groups, Fo)
            gsorted_NF = per_pair.reshape(N, Fo).index_select(0, order_N)
            if ctx.needs_input_grad[2]:
                grad_g_N = (gsorted_NF * ys_NF).sum(-1)
                grad_gates = grad_g_N.index_select(0, inverse_N).view(M, k).to(gate_dtype)
            grad_ys_NF = gsorted_NF * g_N[:, None]
        else:
            grad_ys_NF = grad_y.reshape(N, Fo).index_select(0, order_N)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_xs_ND = _sorted_mm(kind, grad_ys_NF, w_EDF.transpose(1, 2), plan)
            # index_add into [M, D] needs one [M, D] buffer where a gather-then-sum over K would
            # allocate [N, D]; on CPU fresh large buffers cost page faults comparable to the GEMM.
            grad_x = grad_xs_ND.new_zeros(M, D).index_add_(0, rows_N, grad_xs_ND)
        if ctx.needs_input_grad[1]:
            grad_w = _sorted_weight_grad(kind, xs_ND, grad_ys_NF, plan)
        return grad_x, grad_w, grad_gates, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------


def _resolve_name(impl: str, x: torch.Tensor, w: torch.Tensor) -> str:
    """Check the name; fall back from "grouped" where grouped_mm cannot run."""
    if impl not in IMPLEMENTATIONS + ("auto",):
        raise ValueError(f"unknown expert-matmul implementation {impl!r}; "
                         f"choose one of {', '.join(IMPLEMENTATIONS + ('auto',))}")
    if impl == "grouped" and not (_HAS_GROUPED_MM and _grouped_ok(x, w)):
        return "segment"
    return impl


def choose_impl(impl: str, x_MD: torch.Tensor, w_EDF: torch.Tensor,
                plan: ExpertPlan | None = None, *, k: int = 1, gated: bool = True) -> str:
    """The implementation an expert matmul runs: the one place where "auto" is decided, for
    every layer (SwitchHead, MoA, sigma-MoE, Switch), from the device, the dtype, the shapes and
    the routing in ``plan`` (its grouping and balance). ``k``: experts per output unit (K / G);
    ``gated``: whether the call has gates. A concrete name passes through ("grouped" falls back
    to "segment" where grouped_mm cannot run).

    "auto" on CUDA: "triton" (fused kernels) where triton imports and the dtype is float32,
    float16 or bfloat16, else "grouped" for bfloat16 on Hopper+ (torch's grouped GEMM kernels),
    else "segment". On CPU, where grouped_mm and the segment loop call the same GEMM: "pairs"
    for a handful of pairs, "all" for a handful of rows (decoding, where reading the weights is
    the cost: the table at ``PAIRS_MAX``), then "sets"
    where the plan's expert groups make it pay (``sets_eligible``), "segment" where the average
    expert's GEMM is large (``SEGMENT_MIN_MACS``), else "padded" where ``padding_pays`` (one
    parallel region instead of one per expert), else "segment"."""
    kind = _resolve_name(impl, x_MD, w_EDF)
    if kind != "auto":
        return kind
    if torch.compiler.is_compiling():
        return compiled_impl(x_MD, w_EDF)
    if x_MD.device.type == "cuda":
        if _triton_ok(x_MD):
            return "triton"
        fast = (x_MD.dtype == torch.bfloat16
                and torch.cuda.get_device_capability(x_MD.device)[0] >= 9)
        return "grouped" if fast and _HAS_GROUPED_MM and _grouped_ok(x_MD, w_EDF) else "segment"
    if x_MD.device.type != "cpu" or plan is None:
        return "segment"
    few = few_rows_impl(x_MD, w_EDF, plan.num_pairs)
    if few is not None:
        return few
    if gated and sets_eligible(plan.num_pairs // k, plan.group_size,
                               plan.num_experts // (plan.group_size or 1), k):
        return "sets"
    per_expert = plan.num_pairs // plan.num_experts * x_MD.shape[1] * w_EDF.shape[-1]
    if per_expert >= SEGMENT_MIN_MACS:
        return "segment"
    return "padded" if padding_pays(plan) else "segment"


def few_rows_impl(x_MD: torch.Tensor, w_EDF: torch.Tensor, num_pairs: int) -> str | None:
    """What "auto" takes on CPU for a handful of rows, decided from the shapes before any
    routing exists (the table at ``PAIRS_MAX``): "pairs" for at most as many pairs as there are
    experts, "all" for a few rows, else None (a sorted layout, chosen from the plan)."""
    E = w_EDF.shape[0]
    if num_pairs <= min(E, PAIRS_MAX):
        return "pairs"
    M = x_MD.shape[0]
    if M <= ALL_MAX_ROWS and M * E * w_EDF.shape[1] * w_EDF.shape[2] <= ALL_MAX_MACS:
        return "all"
    return None


def _triton_ok(x: torch.Tensor) -> bool:
    """Whether "auto" takes the fused Triton kernels: CUDA, a kernel dtype, triton importable."""
    return (x.device.type == "cuda" and x.dtype in triton_matmul.DTYPES
            and triton_matmul.triton_available())


def compiled_impl(x: torch.Tensor, w: torch.Tensor) -> str:
    """What "auto" resolves to inside a torch.compile'd graph (module docstring): no host sync."""
    if _triton_ok(x):  # registered ops (torch.library): the graph keeps them whole
        return "triton"
    if x.device.type == "cuda" and x.dtype == torch.bfloat16 and _HAS_GROUPED_MM \
            and _grouped_ok(x, w):
        return "grouped"
    return "reference"


def _grouped_traced(x_MD, w_EDF, gates_MK, plan: ExpertPlan, k: int, groups: int):
    """"grouped" for torch.compile: the same sorted layout and grouped GEMM as
    ``_SortedExpertMatmul``, written with differentiable ops only (autograd and the compiler see
    ``F.grouped_mm``, which has its own backward), so nothing leaves the graph."""
    M = x_MD.shape[0]
    rows_N = torch.div(plan.order_N, k, rounding_mode="floor")
    ys_NF = F.grouped_mm(x_MD.index_select(0, rows_N), w_EDF, offs=plan.offsets_E)
    y_MKF = ys_NF.index_select(0, plan.inverse_N).view(M, k, w_EDF.shape[-1])
    return combine(y_MKF, gates_MK, groups)


def _unit_k(idx_MK: torch.Tensor, groups: int) -> int:
    return idx_MK.shape[1] // groups


def _set_layout(plan: ExpertPlan, idx_MK: torch.Tensor, k: int):
    """The set layout of ``plan`` for units of k experts, built once and cached on the plan."""
    return plan._get(("sets", k),
                     lambda: set_layout(idx_MK.reshape(-1, k).to(torch.int64), plan.group_size))


def chosen_impl(impl: str, x_MD: torch.Tensor, idx_MK: torch.Tensor, w_EDF: torch.Tensor, *,
                group_size: int | None = None, gated: bool = True, groups: int = 1) -> str:
    """The implementation ``expert_matmul(x_MD, idx_MK, w_EDF, gates, groups=groups, impl=impl,
    plan=make_plan(idx_MK, E, group_size=group_size))`` runs (``choose_impl``)."""
    plan = make_plan(idx_MK, w_EDF.shape[0], group_size=group_size)
    return choose_impl(impl, x_MD, w_EDF, plan, k=_unit_k(idx_MK, groups), gated=gated)


def _validate(x, idx, w, gates, groups, sum_rows=1, batch=None):
    if x.dim() != 2:
        raise ValueError(f"x must be [M, D], got shape {tuple(x.shape)}")
    if idx.dim() != 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(f"idx must be [M, K] with M = {x.shape[0]} (rows of x), "
                         f"got shape {tuple(idx.shape)}")
    if w.dim() != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be [E, D, F] with D = {x.shape[1]} (width of x), "
                         f"got shape {tuple(w.shape)}")
    if gates is not None and gates.shape != idx.shape:
        raise ValueError(f"gates must have the shape of idx {tuple(idx.shape)}, "
                         f"got {tuple(gates.shape)}")
    if groups < 1 or idx.shape[1] % groups:
        raise ValueError(f"groups={groups} must be a positive divisor of K={idx.shape[1]}")
    if sum_rows < 1 or x.shape[0] % sum_rows:
        raise ValueError(f"sum_rows={sum_rows} must be a positive divisor of the number of rows "
                         f"M={x.shape[0]}")
    if sum_rows > 1 and (gates is None or groups != 1):
        raise ValueError("sum_rows > 1 needs gates and groups=1 (it sums gated rows)")
    if batch is not None and (gates is None or sum_rows != 1 or batch < 1 or x.shape[0] % batch):
        raise ValueError(f"batch={batch} needs gates, sum_rows=1 and must divide the number of "
                         f"rows M={x.shape[0]}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")


def expert_matmul(
    x_MD: torch.Tensor,
    idx_MK: torch.Tensor,
    w_EDF: torch.Tensor,
    gates_MK: torch.Tensor | None = None,
    *,
    groups: int = 1,
    sum_rows: int = 1,
    impl: str = "auto",
    plan: ExpertPlan | None = None,
    batch: int | None = None,
) -> torch.Tensor:
    """Multiply each row by the weights of each of its experts (see the module docstring).

    Returns [M, K, F] without gates; with gates the gate-weighted sum over K, [M, F], or with
    ``groups=G`` the sums over G consecutive equal groups of K, [M, G, F]; with
    ``sum_rows=R`` (gated, groups=1) also summed over every R consecutive rows, [M / R, F].
    ``batch=B`` (gated): rows are B sequences of S = M / B, and the result is laid out
    [B, G, S, F], group-major per sequence as attention takes it (contiguous from "sets", a
    view otherwise). ``plan`` (from ``make_plan(idx_MK, E)``) lets several calls share one sort.
    """
    # Autocast's matmul policy applied to the operands, then every implementation runs in
    # their dtype with autocast off (moeify.ops.amp: the same result dtype on every device).
    x_MD, w_EDF = autocast_cast(x_MD, w_EDF)
    _validate(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows, batch)
    with autocast_off(x_MD.device.type):
        y = _expert_matmul(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows, impl, plan, batch)
    if batch is None:
        return y
    if y.dim() == 4:  # laid out by the implementation
        return y
    M, Fo = x_MD.shape[0], w_EDF.shape[-1]
    return y.view(batch, M // batch, groups, Fo).transpose(1, 2)


def _expert_matmul(x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows, impl, plan, batch):
    E = w_EDF.shape[0]
    if plan is None:
        plan = None if impl in PLANLESS else make_plan(idx_MK, E)
    elif plan.num_experts != E or plan.num_pairs != idx_MK.numel():
        raise ValueError(f"plan was built for {plan.num_pairs} pairs over {plan.num_experts} "
                         f"experts, but idx has {idx_MK.numel()} pairs and w has {E} experts")
    k = _unit_k(idx_MK, groups)
    kind = choose_impl(impl, x_MD, w_EDF, plan, k=k, gated=gates_MK is not None)
    # Named in profiler traces, so that reports can say which implementation really ran.
    with trace(kind):
        return _run(kind, x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows, plan, batch, k)


def _run(kind, x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows, plan, batch, k):
    if kind in PLANLESS:
        if plan is None:  # make_plan has checked them
            _check_ids(idx_MK, w_EDF.shape[0])
        return PLANLESS_FNS[kind](x_MD, idx_MK, w_EDF, gates_MK, groups, sum_rows)
    K = idx_MK.shape[1]
    if kind == "sets":
        if gates_MK is None or plan.group_size is None:
            raise ValueError('impl="sets" needs gates and a plan built with make_plan(..., '
                             'group_size=E) (experts in groups of E consecutive ids)')
        M, Fo = x_MD.shape[0], w_EDF.shape[-1]
        order = None if batch is None else head_major_order(M * groups, groups, batch,
                                                            x_MD.device)
        y = SetExpertMatmul.apply(x_MD, w_EDF, gates_MK.reshape(-1, k),
                                  _set_layout(plan, idx_MK, k), groups, sum_rows, order)
        if batch is not None:
            return y.view(batch, groups, M // batch, Fo)
        return y.view(M, groups, Fo) if groups > 1 else y
    if kind == "triton":
        triton_matmul.check_runnable(x_MD)
        return triton_matmul.triton_expert_matmul(x_MD, w_EDF, gates_MK, plan, K, groups,
                                                  sum_rows)
    if kind == "grouped" and torch.compiler.is_compiling():
        return sum_rows_(_grouped_traced(x_MD, w_EDF, gates_MK, plan, K, groups), sum_rows)
    if kind == "padded":
        # The row sum happens inside: the output gradient is gathered per slot from [M / R, F].
        return PaddedExpertMatmul.apply(x_MD, w_EDF, gates_MK, padded_layout(plan), K, groups,
                                        sum_rows)
    rows_N = torch.div(plan.order_N, K, rounding_mode="floor")
    return sum_rows_(_SortedExpertMatmul.apply(x_MD, w_EDF, gates_MK, plan.order_N,
                                               plan.inverse_N, rows_N, plan, kind, K, groups),
                     sum_rows)


