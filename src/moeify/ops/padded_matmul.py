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

Padding slots gather row 0 and are zeroed; their output gradient is zeroed too, so they
contribute nothing to any output or gradient. Gated outputs are summed from the slots into their
output rows with one index_add, and so is the input gradient into [M, D]: no [N, D] or [N, F]
intermediate is formed on either side (ungated outputs are read back at ``slot_N``). Only the
(unpadded) inputs are saved: the gathered [P, D] rows are rebuilt in the backward rather than
kept alive between the passes, and the gate gradient is taken from the input side (see the
backward), so no [P, F] product is kept either.

Gates are applied on the narrower side of the product: on the [P, D] inputs when D < F
(SwitchHead's output experts, d_head -> d_model), else on the [P, F] outputs (value experts,
d_model -> d_head), so no gate multiply touches the wide side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
    else:  # blocked layout: b = N / (4E) rounded up to a multiple of 8
        b = 8 * math.ceil(N / (32 * E))
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


def _gather_rows(x_MD, lay: PaddedLayout, row_P):
    xs_PD = x_MD.index_select(0, row_P)
    if lay.pad_P.numel():
        xs_PD.index_fill_(0, lay.pad_P, 0)
    return xs_PD


def _block_weights(w_EDF, lay: PaddedLayout):
    return w_EDF if lay.block_expert is None else w_EDF.index_select(0, lay.block_expert)


class PaddedExpertMatmul(torch.autograd.Function):
    """y = expert matmul over the padded layout; same contract as the sorted implementations
    (module docstring of moeify.ops.expert_matmul). Inputs are pre-validated."""

    @staticmethod
    def forward(ctx, x_MD, w_EDF, gates_MK, lay: PaddedLayout, k: int, groups: int,
                sum_rows: int = 1):
        M, D = x_MD.shape
        Fo = w_EDF.shape[-1]
        L, b, dt = lay.n_blocks, lay.block, x_MD.dtype
        row_P = torch.div(lay.pair_P, k, rounding_mode="floor")
        xs_PD = _gather_rows(x_MD, lay, row_P)
        gated = gates_MK is not None
        gate_in = gated and D < Fo
        gate_P = gates_MK.reshape(-1).index_select(0, lay.pair_P).to(dt) if gated else None
        a_PD = xs_PD * gate_P[:, None] if gate_in else xs_PD
        ys_PF = torch.bmm(a_PD.view(L, b, D), _block_weights(w_EDF, lay)).view(L * b, Fo)
        grow_P = None
        if not gated:
            y = ys_PF.index_select(0, lay.slot_N).view(M, k, Fo)
        else:
            # Output row of each slot: its row's group, or its block of R rows.
            if sum_rows > 1:
                grow_P = torch.div(lay.pair_P, k * sum_rows, rounding_mode="floor")
            else:
                grow_P = row_P * groups + torch.div(lay.pair_P % k, k // groups,
                                                    rounding_mode="floor")
            gated_PF = ys_PF if gate_in else ys_PF.mul_(gate_P[:, None])
            # The gated sums straight from the slots (padding slots hold zeros).
            n_out = M * groups // sum_rows
            y = gated_PF.new_zeros(n_out, Fo).index_add_(0, grow_P, gated_PF)
            y = y.view(M, groups, Fo) if groups > 1 else y
        ctx.save_for_backward(x_MD, w_EDF, gate_P, row_P, grow_P)
        ctx.meta = (lay, k, groups, sum_rows, gated, gate_in,
                    gates_MK.dtype if gated else None)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_MD, w_EDF, gate_P, row_P, grow_P = ctx.saved_tensors
        lay, k, groups, sum_rows, gated, gate_in, gate_dtype = ctx.meta
        M, D = x_MD.shape
        E, _, Fo = w_EDF.shape
        L, b = lay.n_blocks, lay.block
        grad_y = grad_y.contiguous()  # also materialises stride-0 gradients
        need_x, need_w, need_g = ctx.needs_input_grad[:3]
        need_g = gated and need_g
        grad_x = grad_w = grad_gates = None
        # Slot p receives the gradient of the output row it was summed into.
        if gated:
            g_PF = grad_y.view(-1, Fo).index_select(0, grow_P)
        else:
            g_PF = grad_y.view(M * k, Fo).index_select(0, lay.pair_P)
        if lay.pad_P.numel():
            g_PF.index_fill_(0, lay.pad_P, 0)
        # With either gate side, ga = g @ Wᵀ (the slot's output gradient before gating, taken
        # back through its expert) gives d/dgate = ga · xs and d/dxs = gate · ga: the gate
        # gradient needs no saved [P, F] outputs.
        xs_PD = _gather_rows(x_MD, lay, row_P) if need_g or (need_w and gate_in) else None
        g_LbF = g_PF.view(L, b, Fo)
        if need_x or need_g:
            wt = _block_weights(w_EDF, lay).transpose(1, 2)
            ga_PD = torch.bmm(g_LbF, wt).view(L * b, D)
            if need_g:
                grad_gates = torch.linalg.vecdot(ga_PD, xs_PD)
            if need_x:
                if gated:
                    ga_PD.mul_(gate_P[:, None])
                grad_x = ga_PD.new_zeros(M, D).index_add_(0, row_P, ga_PD)
            del ga_PD  # before the inputs are gathered again for the weight gradient
        if need_w:
            if xs_PD is None:
                xs_PD = _gather_rows(x_MD, lay, row_P)
            if gated:  # the gate on whichever side the forward applied it
                g_LbF = g_LbF if gate_in else (g_PF * gate_P[:, None]).view(L, b, Fo)
                xs_PD = xs_PD * gate_P[:, None] if gate_in else xs_PD
            grad_w = torch.bmm(xs_PD.view(L, b, D).transpose(1, 2), g_LbF)
            if lay.block_expert is not None:
                grad_w = grad_w.new_zeros(E, D, Fo).index_add_(0, lay.block_expert, grad_w)
        if grad_gates is not None:
            grad_gates = grad_gates.index_select(0, lay.slot_N).view(M, k).to(gate_dtype)
        return grad_x, grad_w, grad_gates, None, None, None, None
