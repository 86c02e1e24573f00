"""The "padded" expert matmul: every expert's rows in one batched matmul.

Shape legend
    M  rows          K  experts per row       E  experts          N = M * K routed pairs
    D  input width   F  output width          G  output groups    R  rows summed per output
    L  blocks        b  rows per block        P = L * b padded slots

The routed pairs, sorted by expert (``ExpertPlan``), are cut into blocks of b rows, each block
holding pairs of a single expert (an expert's last block is padded). One ``torch.bmm`` over
[L, b, D] x [L, D, F] then does every expert's work, where the per-expert loop ("segment")
issues E matmuls. Each matmul is its own parallel region; with several threads a region costs a
thread wake-up (microseconds on an idle machine, milliseconds on a busy one), so one region
instead of E pays for some padding. Two layouts:

    capacity  one block per expert, b = the largest expert's count: no weight copies, used when
              that wastes at most ``CAPACITY_SLACK`` (balanced routing);
    blocked   b = ceil(N / (4E)) rounded up to 8, so padding is at most a quarter of N however
              unbalanced the routing; the weights are gathered per block ([L, D, F]) and their
              gradient summed back per expert with one index_add.

Padding slots hold zero rows, and their output gradient is zeroed in the backward, so they
contribute nothing to any output or weight gradient. Only the (unpadded) inputs are saved: the
gathered [P, D] rows are rebuilt in the backward rather than kept alive between the passes, in
the buffer of the [P, D] input-side gradient once that is summed (see the backward).

Gated sums run as one weighted bag sum (``slot_sums``: torch's embedding_bag, one bag per output
row, its pairs' gates as per-sample weights): the gate multiply and the sum over a row's slots
in a single parallel pass, where a multiply and an index_add (which runs on one thread) would
each stream the [P, F] products. The input gradient is the same kind of sum over [M, P]. So the
gates act on the output side in the forward, and the gate gradient is taken from the input side
(see the backward), so no [P, F] product is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeify.ops.amp import amp_backward, amp_forward

# Largest padding (padded slots / routed pairs) for which one block per expert is used.
CAPACITY_SLACK = 1.25
# ``padding_pays`` single-threaded: there is no thread wake-up to save, so pad only when it is
# nearly free; the per-expert loop is used otherwise.
SINGLE_THREAD_SLACK = 1.1


@dataclass(frozen=True)
class PaddedLayout:
    """Where each routed pair sits in the [L, b] grid of blocks (see module docstring)."""

    block: int  # b
    n_blocks: int  # L
    block_expert: torch.Tensor | None  # int64 [L]: expert of each block; None: block e = expert e
    slot_N: torch.Tensor  # int64 [N]: flat pair index -> slot
    pair_P: torch.Tensor  # int64 [P]: slot -> flat pair index (0 for padding)
    pad_P: torch.Tensor  # int64 [P - N]: the padding slots


def _capacity(plan) -> int:
    cap = plan._cache.get("capacity")
    if cap is None:
        cap = int(plan.counts_E.max()) if plan.num_pairs else 0  # host sync: CPU only
        plan._cache["capacity"] = cap
    return cap


def padded_layout(plan) -> PaddedLayout:
    """The padded layout of an ExpertPlan, computed once per plan (cached on it)."""
    lay = plan._cache.get("padded")
    if lay is not None:
        return lay
    E, N = plan.num_experts, plan.num_pairs
    counts_E = plan.counts_E
    dev = counts_E.device
    cap = _capacity(plan)
    if E * cap <= CAPACITY_SLACK * N or N == 0:  # capacity layout: block e is expert e
        b, L, blocks_E, block_expert = cap, E, torch.ones_like(counts_E), None
    else:  # blocked layout
        b = blocked_block(N, E)
        blocks_E = torch.div(counts_E + (b - 1), b, rounding_mode="floor")
        L = int(blocks_E.sum())
        block_expert = torch.repeat_interleave(torch.arange(E, device=dev), blocks_E,
                                               output_size=L)
    slot_start_E = (torch.cumsum(blocks_E, 0) - blocks_E) * b
    start_E = plan.offsets_E.to(torch.int64) - counts_E
    # Sorted position s belongs to expert e_s at rank s - start[e_s] within its blocks.
    e_sorted = torch.repeat_interleave(torch.arange(E, device=dev), counts_E, output_size=N)
    slot_sorted = torch.arange(N, device=dev) + (slot_start_E - start_E).index_select(0, e_sorted)
    P = L * b
    pair_P = torch.zeros(P, dtype=torch.int64, device=dev).index_copy_(0, slot_sorted,
                                                                        plan.order_N)
    free_P = torch.ones(P, dtype=torch.bool, device=dev).index_fill_(0, slot_sorted, False)
    lay = PaddedLayout(b, L, block_expert, slot_sorted.index_select(0, plan.inverse_N), pair_P,
                       free_P.nonzero().squeeze(1))
    plan._cache["padded"] = lay
    return lay


def padding_pays(plan) -> bool:
    """Whether "auto" should take the padded layout for this routing (module docstring)."""
    N = plan.num_pairs
    if N == 0:
        return False
    if torch.get_num_threads() > 1:
        return True
    return plan.num_experts * _capacity(plan) <= SINGLE_THREAD_SLACK * N


def blocked_block(n_items: int, n_groups: int) -> int:
    """Block height of the blocked layout: n_items / (4 · n_groups) rounded up to a multiple of
    8, so that padding is at most a quarter of the items however unbalanced the groups."""
    return 8 * math.ceil(n_items / (32 * n_groups))


def gather_rows(x_MD: torch.Tensor, lay, row_P: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of every slot, padding slots (``lay.pad_P``) zeroed, so that not even a
    non-finite row 0 reaches another row's output or a weight gradient. ``out``: a [P, D]
    buffer to write them into."""
    xs = x_MD.index_select(0, row_P) if out is None else torch.index_select(x_MD, 0, row_P,
                                                                             out=out)
    return xs.index_fill_(0, lay.pad_P, 0) if lay.pad_P.numel() else xs


def _block_weights(w_EDF, lay: PaddedLayout):
    return w_EDF if lay.block_expert is None else w_EDF.index_select(0, lay.block_expert)


def _row_dot(a_ND: torch.Tensor, b_ND: torch.Tensor) -> torch.Tensor:
    """a[n] · b[n], as N batched 1 x D x 1 products: unlike ``(a * b).sum(-1)`` (or
    ``linalg.vecdot``), no [N, D] temporary is written and read back."""
    D = a_ND.shape[1]
    return torch.bmm(a_ND.view(-1, 1, D), b_ND.view(-1, D, 1)).view(-1)


def slot_sums(src_PF: torch.Tensor, slot_N: torch.Tensor, weight_N: torch.Tensor | None,
              per_row: int) -> torch.Tensor:
    """out[r] = Σ_j weight[n] · src[slot[n]] over the ``per_row`` consecutive pairs n = r·per_row
    + j of output row r: [N / per_row, F]. One ``embedding_bag`` (bags = output rows, the weights
    as per-sample weights): a single parallel pass with no [N, F] temporary, measured 2.4-3x
    faster than the CSR sparse-dense product at the 47M shapes; the gather-and-sum it stands for
    where embedding_bag has no kernel (the reference the tests compare against)."""
    N, Fo = slot_N.shape[0], src_PF.shape[1]
    n_out = N // per_row
    if N == 0:
        return src_PF.new_zeros(0, Fo)
    try:
        return F.embedding_bag(slot_N.view(n_out, per_row), src_PF, mode="sum",
                               per_sample_weights=None if weight_N is None
                               else weight_N.view(n_out, per_row))
    except (RuntimeError, NotImplementedError):  # a dtype or device without the kernel
        pass
    g = src_PF.index_select(0, slot_N)
    if weight_N is not None:
        g = g * weight_N[:, None]
    return g.view(n_out, per_row, Fo).sum(1)


def sum_by_id(src_L: torch.Tensor, ids_L: torch.Tensor, n: int) -> torch.Tensor:
    """out[i] = Σ_{l: ids[l] = i} src[l], [n, ...]: the per-block weight gradients summed into
    their experts: ``zeros(n, ...).index_add_(0, ids, src)`` (the reference the tests compare
    against) as one ``embedding_bag`` over the rows sorted by id (a stable sort: each id's rows
    are summed in their order). torch's CPU index_add of [L, D, F] slices runs a scatter over
    every element, measured 70x slower at the 47M SwitchHead shapes ([40, 412, 76] into 10
    experts: 76 ms against 1 ms on two threads)."""
    L, tail = src_L.shape[0], src_L.shape[1:]
    if L == 0:
        return src_L.new_zeros(n, *tail)
    try:
        order = torch.argsort(ids_L, stable=True)
        counts = torch.zeros(n, dtype=torch.int64, device=ids_L.device).scatter_add_(
            0, ids_L, torch.ones_like(ids_L))
        return F.embedding_bag(order, src_L.reshape(L, -1), torch.cumsum(counts, 0) - counts,
                               mode="sum").view(n, *tail)
    except (RuntimeError, NotImplementedError):  # a dtype or device without the kernel
        return src_L.new_zeros(n, *tail).index_add_(0, ids_L, src_L)


class PaddedExpertMatmul(torch.autograd.Function):
    """y = expert matmul over the padded layout; same contract as the sorted implementations
    (module docstring of moeify.ops.expert_matmul). Inputs are pre-validated."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_MD, w_EDF, gates_MK, lay: PaddedLayout, k: int, groups: int,
                sum_rows: int = 1):
        M, D = x_MD.shape
        Fo = w_EDF.shape[-1]
        L, b = lay.n_blocks, lay.block
        row_P = torch.div(lay.pair_P, k, rounding_mode="floor")
        xs_PD = gather_rows(x_MD, lay, row_P)
        ys_PF = torch.bmm(xs_PD.view(L, b, D), _block_weights(w_EDF, lay)).view(L * b, Fo)
        gate_N = None
        if gates_MK is None:
            y = ys_PF.index_select(0, lay.slot_N).view(M, k, Fo)
        else:
            # Output row r sums the pairs [r·c, (r + 1)·c): a row's group of k / G experts, or
            # all k experts of R consecutive rows.
            gate_N = gates_MK.reshape(-1).to(x_MD.dtype)
            y = slot_sums(ys_PF, lay.slot_N, gate_N, k // groups * sum_rows)
            y = y.view(M, groups, Fo) if groups > 1 else y
        ctx.save_for_backward(x_MD, w_EDF, gate_N, row_P)
        ctx.meta = (lay, k, groups, sum_rows, gates_MK.dtype if gates_MK is not None else None)
        return y

    @staticmethod
    @amp_backward
    def backward(ctx, grad_y):
        x_MD, w_EDF, gate_N, row_P = ctx.saved_tensors
        lay, k, groups, sum_rows, gate_dtype = ctx.meta
        M, D = x_MD.shape
        E, _, Fo = w_EDF.shape
        L, b = lay.n_blocks, lay.block
        gated = gate_N is not None
        grad_y = grad_y.contiguous()  # also materialises stride-0 gradients
        need_x, need_w, need_g = ctx.needs_input_grad[:3]
        need_g = gated and need_g
        grad_x = grad_w = grad_gates = None
        # Slot p receives the gradient of the output row its pair was summed into.
        per_out = k // groups * sum_rows if gated else 1
        out_P = torch.div(lay.pair_P, per_out, rounding_mode="floor")
        g_PF = gather_rows(grad_y.view(-1, Fo), lay, out_P)
        w_LDF = _block_weights(w_EDF, lay)
        ga_PD = None
        if need_x or (need_g and D <= Fo):
            # ga = g @ Wᵀ, the slot's output gradient before gating taken back through its
            # expert: d/dx sums gate · ga over a row's pairs.
            ga_PD = torch.bmm(g_PF.view(L, b, Fo), w_LDF.transpose(1, 2)).view(L * b, D)
            if need_x:
                grad_x = slot_sums(ga_PD, lay.slot_N, gate_N, k)
        if need_g or need_w:
            # d/dgate = ga · xs = g · (xs W): taken on the narrower side. For D > F that is
            # g · (xs W), ga is then no longer needed and the rows are gathered into its buffer:
            # the two [P, D] tensors are never alive together (one extra [P, D] x [D, F] bmm).
            reuse = ga_PD if ga_PD is not None and D > Fo else None
            xs_PD = gather_rows(x_MD, lay, row_P, out=reuse)
            if need_g:
                dots_P = (_row_dot(ga_PD, xs_PD) if D <= Fo else _row_dot(
                    torch.bmm(xs_PD.view(L, b, D), w_LDF).view(L * b, Fo), g_PF))
                grad_gates = dots_P.index_select(0, lay.slot_N).view(M, k).to(gate_dtype)
            if need_w:
                grad_w = _weight_grad(xs_PD, g_PF, gate_N, w_LDF, lay, E)
        return grad_x, grad_w, grad_gates, None, None, None, None


def _weight_grad(xs_PD, g_PF, gate_N, w_LDF, lay: PaddedLayout, E: int) -> torch.Tensor:
    """Σ over each expert's slots of xsᵀ (gate · g), [E, D, F] (PaddedExpertMatmul.backward).
    xs and g are the backward's own gathers, no longer needed: the gate is multiplied into the
    narrower one in place, and the blocked layout's per-block products are written over its
    gathered block weights, then summed into their experts (``sum_by_id``)."""
    D, Fo = xs_PD.shape[1], g_PF.shape[1]
    L, b = lay.n_blocks, lay.block
    if gate_N is not None:
        (xs_PD if D <= Fo else g_PF).mul_(gate_N.index_select(0, lay.pair_P)[:, None])
    blocked = lay.block_expert is not None
    grad_w = torch.bmm(xs_PD.view(L, b, D).transpose(1, 2), g_PF.view(L, b, Fo),
                       out=w_LDF if blocked else None)
    return sum_by_id(grad_w, lay.block_expert, E) if blocked else grad_w
