"""The expert-set kernel ("sets", CPU): SwitchHead's (token, head) units sorted by the set of
experts they chose, and the head-major output layout.

The expert-set matmul: units that chose the same set of experts, multiplied together.

Shape legend
    U  units: (row, group) pairs, each routed to K experts of its group    K  experts per unit
    E  experts per group      Gs = C(E, K) possible sets per group        X  weight matrices
    D  input width            F  output width            R  units summed per output row
    L  blocks of a grid       b  units per block of a grid                P  slots, all grids

SwitchHead routes every (token, head) unit to K of the head's E experts (Eq. 7-10). The padded
layout (moeify.ops.moe.cpu.padded) multiplies each of the U·K (unit, expert) pairs on its own:
a narrow product per pair, and K copies of every wide row. With small E and K there are only
Gs = C(E, K) sets per head (10 for E = 5, K = 2), so here units are sorted by (group, set)
instead, and a block of units that share a set is multiplied by the set's K matrices side by
side. The multiply-adds are the same; the matmuls are K times wider and the wide intermediates
K times shorter. Which side of the product the gates act on depends on which is narrower:

    gates on the output (D >= F, SwitchHead's V and K):
        y[u] = Σ_j gate[u, j] · (x[u] [W_1 | ... | W_K])[j]      x [D] -> [K·F] -> F
    gates on the input (D < F, SwitchHead's O and Q):
        y[u] = [gate[u, 1] x[u], ..., gate[u, K] x[u]] [W_1; ...; W_K]          -> F

Both contracts are expert_matmul's gated ones: ``groups`` = G units per input row (output
[rows, G, F]), or ``sum_rows`` = R units per output row (output [rows / R, F]). In the
output-gated form the forward keeps the [P, K·F] products for the gate gradient (g · x W_j), so
no [P, D] product is needed for it in the backward.

Layout. Units sorted by set fill blocks of one set each; every grid of equal blocks is one
torch.bmm. A set's count fluctuates around the mean, so one block per set as tall as the
largest set (the "capacity" layout) pads by 15-20% at the 47M shapes. ``set_layout`` picks the
cheapest of: two grids, every set's first b1 units in one and the overflow of the sets larger
than b1 in a second, lower one (b1 = max is the capacity layout); or, for badly unbalanced
routing, the blocked layout of moeify.ops.moe.cpu.padded (equal blocks, padding at most a
quarter). The cost counted is padded slots plus, per block, the rows a weight copy costs
(``BLOCK_COST``), plus ``GRID_COST`` for a second grid's extra matmul calls.

Eligibility (``sets_eligible``): the plan knows its group size, every unit's K experts lie in
one group, 2 <= K < E, and Gs is small enough that each set has rows to fill a block.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch

from moeify.ops.amp import amp_backward, amp_forward
from moeify.ops.moe.cpu.padded import blocked_block
from moeify.ops.moe.layout import gather_rows, slot_sums, sum_by_id
from moeify.ops.moe.registry import WholeKernel, register

# Largest number of sets per group the layout takes (C(E, K) must not exceed it).
MAX_SETS = 64
# The fewest units per (group, set) block, on average, for "auto" to take the layout. Below it
# the padding of the blocks (a set's count fluctuates around the mean) and the per-call copies
# of the set weights cost about what the wider matmuls save, and the kept [P, K·F] products
# are not worth their memory (the measurements: docs/benchmarks/expert-matmul-cpu-policy.md).
MIN_UNITS_PER_SET = 320
# Layout costs in padded rows (module docstring): a block's weight copy and gradient sum, and a
# second grid's three extra batched matmuls. Rough equivalents measured at the 47M shapes.
BLOCK_COST = 16
GRID_COST = 48


@dataclass(frozen=True)
class Grid:
    """Equal blocks of one set each: slots [start, start + n_blocks · block)."""

    start: int
    n_blocks: int
    block: int
    block_ids_LK: torch.Tensor  # int64 [n_blocks, K]: each block's weight matrices, ascending

    @property
    def stop(self) -> int:
        return self.start + self.n_blocks * self.block


@dataclass(frozen=True)
class SetLayout:
    """Units sorted by expert set, in one or two grids of blocks (module docstring)."""

    k: int  # K
    grids: tuple[Grid, ...]
    n_slots: int  # P
    pair_P: torch.Tensor  # int64 [P]: slot -> unit (0 for padding)
    pad_P: torch.Tensor  # int64: the padding slots
    perm_UK: torch.Tensor  # int64 [U, K]: j-th smallest expert of unit u -> its position in idx
    slot_U: torch.Tensor  # int64 [U]: unit -> slot
    slotk_UK: torch.Tensor  # int64 [U·K]: unit u's j-th expert -> row slot·K + j of a [P·K, ·] view


def n_sets(n_experts: int, k: int) -> int:
    return math.comb(n_experts, k)


def sets_eligible(n_units: int, group_size: int | None, n_groups: int, k: int) -> bool:
    """Whether the set layout applies to and pays for this routing shape (module docstring)."""
    if group_size is None or not 2 <= k < group_size:
        return False
    s = n_sets(group_size, k)
    return s <= MAX_SETS and n_units >= MIN_UNITS_PER_SET * s * n_groups


@functools.lru_cache(maxsize=64)
def _set_table(E: int, K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """All K-subsets of range(E) in lexicographic order [Gs, K], and a lookup from the base-E code
    of a sorted subset (Σ_j e_j · E^(K-1-j)) to its rank."""
    combos = torch.tensor(list(itertools.combinations(range(E), K)), dtype=torch.int64,
                          device=device)
    powers = E ** torch.arange(K - 1, -1, -1, device=device)
    lut = torch.full((E ** K,), -1, dtype=torch.int64, device=device)
    lut[(combos * powers).sum(1)] = torch.arange(combos.shape[0], device=device)
    return combos, lut


def _plan_blocks(counts: list[int]) -> tuple[str, int, int]:
    """The cheapest block shape for these per-set counts (module docstring): ("grids", b1, b2)
    or ("blocked", b, 0)."""
    active = [n for n in counts if n]
    if not active:
        return "grids", 0, 0
    n_active = len(active)
    best = None
    for b1 in sorted(set(active)):
        over = [n - b1 for n in active if n > b1]
        b2 = max(over, default=0)
        cost = (n_active * b1 + len(over) * b2 + BLOCK_COST * (n_active + len(over))
                + (GRID_COST if over else 0))
        if best is None or cost < best[0]:
            best = (cost, "grids", b1, b2)
    b = blocked_block(sum(active), n_active)
    n_blocks = sum(-(-n // b) for n in active)
    if n_blocks * (b + BLOCK_COST) < best[0]:
        return "blocked", b, 0
    return best[1], best[2], best[3]


def set_layout(ids_UK: torch.Tensor, group_size: int) -> SetLayout:
    """The set layout of units whose K ids (group · E + expert, ``group_size`` = E) all lie in one
    group. Raises ValueError otherwise."""
    U, K = ids_UK.shape
    E = group_size
    dev = ids_UK.device
    group_UK = torch.div(ids_UK, E, rounding_mode="floor")
    group_U = group_UK[:, 0]
    if U and not bool((group_UK == group_U[:, None]).all()):
        raise ValueError("the set layout needs every unit's experts in one group of "
                         f"{E} consecutive ids")
    local_sorted, perm_UK = (ids_UK - group_U[:, None] * E).sort(-1)
    combos, lut = _set_table(E, K, dev)  # per (E, K, device), built once
    powers = E ** torch.arange(K - 1, -1, -1, device=dev)
    rank_U = lut.index_select(0, (local_sorted * powers).sum(1))
    if U and bool((rank_U < 0).any()):
        raise ValueError("the set layout needs K distinct experts per unit")
    Gs = combos.shape[0]
    n_all = (int(group_U.max()) + 1 if U else 1) * Gs
    set_U = group_U * Gs + rank_U
    order = torch.argsort(set_U, stable=True)
    counts_S = torch.bincount(set_U, minlength=n_all)
    counts = counts_S.tolist()  # host sync: CPU only
    kind, b1, b2 = _plan_blocks(counts)
    start_S = torch.cumsum(counts_S, 0) - counts_S
    set_sorted = set_U.index_select(0, order)
    rank = torch.arange(U, device=dev) - start_S.index_select(0, set_sorted)
    active = [s for s, n in enumerate(counts) if n]

    def grid(start, sets, block):
        g = torch.tensor(sets, dtype=torch.int64, device=dev)
        h = torch.div(g, Gs, rounding_mode="floor")
        return Grid(start, len(sets), block, combos.index_select(0, g - h * Gs) + h[:, None] * E)

    if kind == "blocked":
        per_set = [-(-n // b1) for n in counts]
        first = torch.tensor([0] + per_set[:-1], device=dev).cumsum(0)
        slot_sorted = first.index_select(0, set_sorted) * b1 + rank
        grids = (grid(0, [s for s in active for _ in range(per_set[s])], b1),)
    else:
        grid_of_S = torch.full((n_all,), -1, dtype=torch.int64, device=dev)
        grid_of_S[active] = torch.arange(len(active), device=dev)
        over = [s for s in active if counts[s] > b1]
        over_of_S = torch.full((n_all,), -1, dtype=torch.int64, device=dev)
        if over:
            over_of_S[over] = torch.arange(len(over), device=dev)
        P1 = len(active) * b1
        slot_sorted = torch.where(
            rank < b1, grid_of_S.index_select(0, set_sorted) * b1 + rank,
            P1 + over_of_S.index_select(0, set_sorted) * b2 + rank - b1)
        grids = tuple(g for g in (grid(0, active, b1), grid(P1, over, b2)) if g.n_blocks)
    P = grids[-1].stop if grids else 0
    pair_P = torch.zeros(P, dtype=torch.int64, device=dev).index_copy_(0, slot_sorted, order)
    free_P = torch.ones(P, dtype=torch.bool, device=dev).index_fill_(0, slot_sorted, False)
    slot_U = torch.empty_like(slot_sorted).index_copy_(0, order, slot_sorted)
    slotk = slot_U[:, None] * K + torch.arange(K, device=dev)
    return SetLayout(K, grids, P, pair_P, free_P.nonzero().squeeze(1), perm_UK, slot_U,
                     slotk.reshape(-1))


def _gather_units(t: torch.Tensor, lay: SetLayout, per_unit: int = 1) -> torch.Tensor:
    """Per slot the row of its unit (row u // per_unit of ``t``), padding slots zeroed."""
    rows = lay.pair_P if per_unit == 1 else torch.div(lay.pair_P, per_unit, rounding_mode="floor")
    return gather_rows(t, lay, rows)


def _sorted_gates(gates_UK: torch.Tensor, lay: SetLayout, order=None) -> torch.Tensor:
    """Each unit's gates in ascending expert order (the order of its set's matrices), [U, K];
    listed in output order when ``order`` is given."""
    out = gates_UK.gather(1, lay.perm_UK)
    return out if order is None else out.index_select(0, order[0])


def _slot_gates(gates_UK: torch.Tensor, lay: SetLayout) -> torch.Tensor:
    """[P, K] gates in each slot's ascending expert order; 0 in padding slots."""
    return _gather_units(_sorted_gates(gates_UK, lay), lay)


def _unsort(grad_sorted_UK: torch.Tensor, lay: SetLayout) -> torch.Tensor:
    return torch.empty_like(grad_sorted_UK).scatter_(1, lay.perm_UK, grad_sorted_UK)


def _set_weights(w_XDF: torch.Tensor, grid: Grid, gates_in: bool) -> torch.Tensor:
    """Each block's K matrices side by side: [L, D, K·F] (gates on the output) or stacked
    [L, K·D, F] (gates on the input)."""
    L, K = grid.block_ids_LK.shape
    _, D, Fo = w_XDF.shape
    w = w_XDF.index_select(0, grid.block_ids_LK.reshape(-1))
    if gates_in:
        return w.view(L, K * D, Fo)
    return w.view(L, K, D, Fo).permute(0, 2, 1, 3).reshape(L, D, K * Fo)


def _grid_bmm(a_PA: torch.Tensor, ws, lay: SetLayout, n: int, transpose: bool = False):
    """[P, n]: every grid's blocks of ``a`` times their block matrices (``ws``, one per grid,
    [L, A, n]; or [L, n, A] read transposed)."""
    out = a_PA.new_empty(lay.n_slots, n)
    for g, w in zip(lay.grids, ws):
        L, b = g.n_blocks, g.block
        torch.bmm(a_PA[g.start:g.stop].view(L, b, -1), w.transpose(1, 2) if transpose else w,
                  out=out[g.start:g.stop].view(L, b, n))
    return out


def head_major_order(U: int, groups: int, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Units u = (b·S + s)·G + g listed in (b, g, s) order, and the inverse map: the output of
    ``groups=G`` laid out [B, G, S, F] (per batch element, group-major: attention's layout)."""
    S = U // (groups * batch)
    b = torch.arange(batch, device=device).view(batch, 1, 1)
    g = torch.arange(groups, device=device).view(1, groups, 1)
    s = torch.arange(S, device=device).view(1, 1, S)
    u_of_o = ((b * S + s) * groups + g).reshape(-1)
    o_of_u = ((b * groups + g) * S + s).permute(0, 2, 1).reshape(-1)
    return u_of_o, o_of_u


class SetExpertMatmul(torch.autograd.Function):
    """expert_matmul's gated contract over the set layout. ``per_row`` = G units per input row
    (``sum_rows`` = 1) or 1 (then ``sum_rows`` = R units per output row). ``order``: None, or
    (u_of_o, o_of_u) from ``head_major_order`` to emit the units in that order."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_MD, w_XDF, gates_UK, lay: SetLayout, per_row: int, sum_rows: int,
                order=None):
        X, D, Fo = w_XDF.shape
        K, P, U = lay.k, lay.n_slots, gates_UK.shape[0]
        gates_in = D < Fo
        xs_PD = _gather_units(x_MD, lay, per_row)
        ws = [_set_weights(w_XDF, g, gates_in) for g in lay.grids]
        if gates_in:
            slot_O = lay.slot_U if order is None else lay.slot_U.index_select(0, order[0])
            gate_PK = _slot_gates(gates_UK.to(x_MD.dtype), lay)
            z = (xs_PD.view(P, 1, D) * gate_PK.view(P, K, 1)).view(P, K * D)
            y = slot_sums(_grid_bmm(z, ws, lay, Fo), slot_O, None, sum_rows)
        else:
            ys_P = _grid_bmm(xs_PD, ws, lay, K * Fo)  # kept for the gate gradient
            del xs_PD
            slotk_O = lay.slotk_UK if order is None else \
                lay.slotk_UK.view(U, K).index_select(0, order[0]).reshape(-1)
            gate_N = _sorted_gates(gates_UK, lay, order).to(x_MD.dtype).reshape(-1)
            y = slot_sums(ys_P.view(-1, Fo), slotk_O, gate_N, K * sum_rows)
        # The set weights are rebuilt in the backward (a copy of about a millisecond at the 47M
        # shapes) rather than kept: with two grids they are several times the expert weights.
        ctx.save_for_backward(x_MD, w_XDF, gates_UK, None if gates_in else ys_P)
        ctx.meta = (lay, per_row, sum_rows, U, order)
        return y

    @staticmethod
    @amp_backward
    def backward(ctx, grad_y):
        x_MD, w_XDF, gates_UK, ys_P = ctx.saved_tensors
        lay, per_row, sum_rows, U, order = ctx.meta
        X, D, Fo = w_XDF.shape
        K, P = lay.k, lay.n_slots
        gates_in = ys_P is None
        need_x, need_w, need_g = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_gates = None
        grad_y = grad_y.contiguous().view(-1, Fo)  # also materialises stride-0 gradients
        # Slot p receives the gradient of the output row its unit was summed into.
        unit_P = lay.pair_P if order is None else order[1].index_select(0, lay.pair_P)
        g_PF = gather_rows(grad_y, lay, torch.div(unit_P, sum_rows, rounding_mode="floor"))
        gate_PK = _slot_gates(gates_UK.to(x_MD.dtype), lay)
        xs_PD = _gather_units(x_MD, lay, per_row) if gates_in or need_w else None
        ws = [_set_weights(w_XDF, g, gates_in) for g in lay.grids] if need_x or gates_in else []
        if need_w:
            grad_w = g_PF.new_zeros(X, D, Fo)
        if gates_in:
            if need_x or need_g:
                # gz[p, j] = g · W_jᵀ: d/dgate_j = gz_j · x, d/dx = Σ_j gate_j gz_j.
                gz = _grid_bmm(g_PF, ws, lay, K * D, transpose=True).view(P * K, D)
                if need_g:
                    dots_PK = torch.bmm(gz.view(P, K, D), xs_PD.view(P, D, 1)).view(P, K)
                    grad_gates = _unsort(dots_PK.index_select(0, lay.slot_U), lay)
                if need_x:
                    gate_N = _sorted_gates(gates_UK, lay).to(x_MD.dtype).reshape(-1)
                    grad_x = slot_sums(gz, lay.slotk_UK, gate_N, K * per_row)
                del gz
            if need_w:
                z = (xs_PD.view(P, 1, D) * gate_PK.view(P, K, 1)).view(P, K * D)
                for g in lay.grids:
                    L, b = g.n_blocks, g.block
                    grad_set = torch.bmm(z[g.start:g.stop].view(L, b, K * D).transpose(1, 2),
                                         g_PF[g.start:g.stop].view(L, b, Fo))
                    grad_w += sum_by_id(grad_set.view(L * K, D, Fo),
                                        g.block_ids_LK.reshape(-1), X)
        else:
            if need_g:
                # d/dgate_j = g · (x W_j): the kept products, no [P, D] term.
                dots_PK = torch.bmm(ys_P.view(P, K, Fo), g_PF.view(P, Fo, 1)).view(P, K)
                grad_gates = _unsort(dots_PK.index_select(0, lay.slot_U), lay)
            if need_x or need_w:
                gg = (g_PF.view(P, 1, Fo) * gate_PK.view(P, K, 1)).view(P, K * Fo)
            if need_x:
                ga_PD = _grid_bmm(gg, ws, lay, D, transpose=True)
                grad_x = slot_sums(ga_PD, lay.slot_U, None, per_row)
                del ga_PD
            if need_w:
                # One [D, K·F] product per block, then its K slices summed into their matrices
                # (K products of width F, reading gg strided, measured a third slower than
                # this one and the copy of its slices).
                for g in lay.grids:
                    L, b = g.n_blocks, g.block
                    grad_set = torch.bmm(xs_PD[g.start:g.stop].view(L, b, D).transpose(1, 2),
                                         gg[g.start:g.stop].view(L, b, K * Fo))
                    grad_w += sum_by_id(grad_set.view(L, D, K, Fo).permute(0, 2, 1, 3)
                                        .reshape(L * K, D, Fo), g.block_ids_LK.reshape(-1), X)
        if grad_gates is not None:
            grad_gates = grad_gates.to(gates_UK.dtype)
        return grad_x, grad_w, grad_gates, None, None, None, None


def plan_set_layout(plan, idx_MK: torch.Tensor, k: int) -> SetLayout:
    """The set layout of ``plan`` for units of k experts, built once and cached on the plan."""
    return plan.cached(("set_layout", k), lambda: set_layout(idx_MK.reshape(-1, k).to(torch.int64),
                                                             plan.group_size))


class SetsKernel(WholeKernel):
    """expert_matmul's gated contract over the set layout (module docstring); needs a plan
    built with ``make_plan(..., group_size=E)``."""

    name = "sets"
    needs_plan = True

    def run(self, x_MD, idx_MK, w_EDF, gates_MK, *, groups, sum_rows, plan, batch):
        if gates_MK is None or plan is None or plan.group_size is None:
            raise ValueError('impl="sets" needs gates and a plan built with make_plan(..., '
                             'group_size=E) (experts in groups of E consecutive ids)')
        M, Fo = x_MD.shape[0], w_EDF.shape[-1]
        k = idx_MK.shape[1] // groups
        order = None if batch is None else head_major_order(M * groups, groups, batch,
                                                            x_MD.device)
        y = SetExpertMatmul.apply(x_MD, w_EDF, gates_MK.reshape(-1, k),
                                  plan_set_layout(plan, idx_MK, k), groups, sum_rows, order)
        if batch is not None:
            return y.view(batch, groups, M // batch, Fo)
        return y.view(M, groups, Fo) if groups > 1 else y


register(SetsKernel())


__all__ = ["Grid", "SetExpertMatmul", "SetLayout", "SetsKernel", "head_major_order", "n_sets",
           "plan_set_layout", "set_layout", "sets_eligible"]
