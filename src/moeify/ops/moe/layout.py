"""Slot layouts: where each routed pair sits among the rows a kernel multiplies, and the
gathers and sums that move rows between pair order and slot order.

Shape legend: M rows, K experts per row, N = M · K routed pairs, P slots (N, or more with
padding), D / F widths, E experts.

A kernel multiplies P slots, each holding one routed pair (or padding): slot p holds pair
``pair_P[p]`` and pair n sits in slot ``slot_N[n]``. The sorted layout is the pairs sorted by
expert (P = N, no padding); the pair layout is the pairs in their own order (P = N, slot p is
pair p: for kernels that read rows through the sort themselves); a kernel may define its own
(padded blocks, moeify.ops.moe.cpu.padded) by deriving from ``SlotLayout``.

A layout refers to its plan weakly. The plan keeps the layouts built from it (so the matmuls
sharing a routing share them), and a strong reference back would make every plan and layout a
reference cycle: freed only when Python's cyclic collector happens to run, so the routing of
earlier steps (sorts, ids, layouts) stayed in memory into later ones. Whoever uses a layout
holds its plan: the callers during the forward, the autograd Functions until the backward for
a kernel whose entry points read it (``ExpertKernel.reads_plan``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moeify.ops.moe.plan import RoutingPlan


class _WeakPlan:
    """The ``plan`` field of a layout, held weakly (module docstring)."""

    def __get__(self, obj, objtype=None):
        if obj is None:
            raise AttributeError("plan")  # a dataclass field without a default
        plan = obj.__dict__["_plan"]()
        if plan is None:
            raise RuntimeError("this layout's RoutingPlan no longer exists: keep a reference to "
                               "the plan while its layout is in use")
        return plan

    def __set__(self, obj, plan: RoutingPlan) -> None:
        obj.__dict__["_plan"] = weakref.ref(plan)


@dataclass(frozen=True, eq=False)
class SlotLayout:
    """The P slots of a kernel (module docstring)."""

    plan: RoutingPlan = _WeakPlan()  # held weakly
    n_slots: int  # P
    pair_P: torch.Tensor  # int64 [P]: slot -> flat pair index (0 for padding)
    slot_N: torch.Tensor  # int64 [N]: flat pair index -> slot
    pad_P: torch.Tensor  # int64: the padding slots
    identity: bool = False  # slot p is pair p
    _memo: dict = field(default_factory=dict, repr=False)

    def rows(self, per: int) -> torch.Tensor:
        """[P]: the row of each slot's pair when rows hold ``per`` consecutive pairs
        (pair // per); 0 for padding."""
        v = self._memo.get(per)
        if v is None:
            v = self._memo[per] = torch.div(self.pair_P, per, rounding_mode="floor")
        return v

    def input_rows(self, k: int | None) -> torch.Tensor:
        """[P]: the input row of each slot's pair: pair // k for ``k`` experts per row, or, with
        k None, its row under a variable-k plan (``plan.row_N``); padding slots read the row of
        pair 0 (``gather_rows`` zeroes them)."""
        if k is not None:
            return self.rows(k)
        v = self._memo.get("pair_rows")
        if v is None:
            v = self._memo["pair_rows"] = self.plan.row_N.index_select(0, self.pair_P)
        return v


def sorted_layout(plan: RoutingPlan) -> SlotLayout:
    """The pairs sorted by expert, no padding (built once per plan)."""
    return plan.cached("sorted_layout", lambda: SlotLayout(
        plan, plan.num_pairs, plan.order_N, plan.inverse_N, plan.order_N[:0]))


def pair_layout(plan: RoutingPlan) -> SlotLayout:
    """The pairs in their own order, slot p = pair p (built once per plan)."""
    def build():
        ar = torch.arange(plan.num_pairs, device=plan.device)
        return SlotLayout(plan, plan.num_pairs, ar, ar, ar[:0], identity=True)
    return plan.cached("pair_layout", build)


def gather_rows(t_MD: torch.Tensor, lay: SlotLayout, rows_P: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """[P, D]: the row ``rows_P[p]`` of ``t`` for every slot, padding slots zeroed, so that not
    even a non-finite row 0 reaches another row's output or a weight gradient. ``out``: a
    [P, D] buffer to write them into."""
    xs = t_MD.index_select(0, rows_P) if out is None else torch.index_select(t_MD, 0, rows_P,
                                                                             out=out)
    return xs.index_fill_(0, lay.pad_P, 0) if lay.pad_P.numel() else xs


def slot_sums(src_PF: torch.Tensor, slot_N: torch.Tensor, weight_N: torch.Tensor | None,
              per_row: int) -> torch.Tensor:
    """out[r] = Σ_j weight[n] · src[slot[n]] over the ``per_row`` consecutive pairs n = r·per_row
    + j of output row r: [N / per_row, F]. One ``embedding_bag`` (bags = output rows, the
    weights as per-sample weights): a single parallel pass with no [N, F] temporary; the
    gather-and-sum it stands for where embedding_bag has no kernel (a dtype or device)."""
    N, Fo = slot_N.shape[0], src_PF.shape[1]
    n_out = N // per_row
    if N == 0:
        return src_PF.new_zeros(0, Fo)
    try:
        return F.embedding_bag(slot_N.view(n_out, per_row), src_PF, mode="sum",
                               per_sample_weights=None if weight_N is None
                               else weight_N.view(n_out, per_row))
    except (RuntimeError, NotImplementedError):
        pass
    g = src_PF.index_select(0, slot_N)
    if weight_N is not None:
        g = g * weight_N[:, None]
    return g.view(n_out, per_row, Fo).sum(1)


def row_sums(src_PF: torch.Tensor, slot_N: torch.Tensor, weight_N: torch.Tensor | None,
             plan: RoutingPlan) -> torch.Tensor:
    """Variable k: out[m] = Σ weight[n] · src[slot[n]] over row m's pairs n (``plan.row_N``,
    in row order), [M, F]; a row without pairs is 0. One ``embedding_bag`` whose bags are the
    rows (``plan.row_offsets_M``), or an ``index_add`` where it has no kernel."""
    M, Fo = plan.n_rows, src_PF.shape[1]
    if slot_N.shape[0] == 0:
        return src_PF.new_zeros(M, Fo)
    try:
        return F.embedding_bag(slot_N, src_PF, plan.row_offsets_M, mode="sum",
                               per_sample_weights=weight_N, include_last_offset=True)
    except (RuntimeError, NotImplementedError):
        pass
    g = src_PF.index_select(0, slot_N)
    if weight_N is not None:
        g = g * weight_N[:, None]
    return src_PF.new_zeros(M, Fo).index_add_(0, plan.row_N, g)


def sums_to_rows(src_PF: torch.Tensor, lay: SlotLayout, weight_N: torch.Tensor | None,
                 k: int | None) -> torch.Tensor:
    """The (weighted) sums of each input row's pairs: ``slot_sums`` for ``k`` pairs per row,
    ``row_sums`` of the variable-k plan with k None."""
    if k is None:
        return row_sums(src_PF, lay.slot_N, weight_N, lay.plan)
    return slot_sums(src_PF, lay.slot_N, weight_N, k)


def sum_by_id(src_L: torch.Tensor, ids_L: torch.Tensor, n: int) -> torch.Tensor:
    """out[i] = Σ_{l: ids[l] = i} src[l], [n, ...]: ``zeros(n, ...).index_add_(0, ids, src)``
    (the reference the tests compare against) as one ``embedding_bag`` over the rows sorted by
    id (a stable sort: each id's rows are summed in their order). torch's CPU index_add of
    [L, D, F] slices runs a scatter over every element, about 70x slower for per-block weight
    gradients (docs/benchmarks/expert-matmul-cpu-policy.md)."""
    L, tail = src_L.shape[0], src_L.shape[1:]
    if L == 0:
        return src_L.new_zeros(n, *tail)
    try:
        order = torch.argsort(ids_L, stable=True)
        counts = torch.zeros(n, dtype=torch.int64, device=ids_L.device).scatter_add_(
            0, ids_L, torch.ones_like(ids_L))
        return F.embedding_bag(order, src_L.reshape(L, -1), torch.cumsum(counts, 0) - counts,
                               mode="sum").view(n, *tail)
    except (RuntimeError, NotImplementedError):
        return src_L.new_zeros(n, *tail).index_add_(0, ids_L, src_L)


def row_dot(a_ND: torch.Tensor, b_ND: torch.Tensor) -> torch.Tensor:
    """a[n] · b[n], as N batched 1 x D x 1 products: unlike ``(a * b).sum(-1)`` no [N, D]
    temporary is written and read back."""
    D = a_ND.shape[1]
    return torch.bmm(a_ND.reshape(-1, 1, D), b_ND.reshape(-1, D, 1)).view(-1)


__all__ = ["SlotLayout", "gather_rows", "pair_layout", "row_dot", "row_sums", "slot_sums",
           "sorted_layout", "sum_by_id", "sums_to_rows"]
