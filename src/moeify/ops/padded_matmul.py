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
contribute nothing to any output or gradient. Gated
outputs are summed from the slots into their output rows with one index_add, and so is the input
gradient into [M, D]: no [N, D] or [N, F] intermediate is formed on either side (ungated outputs
are read back at ``slot_N``). Only the (unpadded) inputs are saved: the gathered rows are rebuilt
in the backward rather than kept alive between the passes, and the gate gradient is taken from
the input side (see the backward), so no [P, F] product is kept either.

Both passes walk the blocks in chunks of at most ``CHUNK_BYTES`` of wide-side rows, so the
gathered rows and products of a large batch never exist for all P slots at once (one chunk at
the benchmark shapes: smaller chunks measured slower, each adding its own parallel regions).

Gates are applied on the narrower side of the product: on the [P, D] inputs when D < F
(SwitchHead's output experts, d_head -> d_model), else on the [P, F] outputs (value experts,
d_model -> d_head), so no gate multiply touches the wide side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Largest padding (padded slots / routed pairs) for which one block per expert is used.
CAPACITY_SLACK = 1.25
# ``padding_pays`` single-threaded: there is no thread wake-up to save, so pad only when it is
# nearly free; the per-expert loop is used otherwise.
SINGLE_THREAD_SLACK = 1.1
# Most bytes of wide-side rows ([rows, max(D, F)]) one chunk of blocks handles at a time: a bound
# on the temporaries of both passes (module docstring).
CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class PaddedLayout:
    """Where each routed pair sits in the [L, b] grid of blocks (see module docstring)."""

    block: int  # b
    n_blocks: int  # L
    block_expert: torch.Tensor | None  # int64 [L]: expert of each block; None: block e = expert e
    slot_N: torch.Tensor  # int64 [N]: flat pair index -> slot
    pair_P: torch.Tensor  # int64 [P]: slot -> flat pair index (0 for padding)
    pad_P: torch.Tensor  # int64 [P - N]: the padding slots, ascending
    pad_bounds: list[int]  # [L + 1]: pad_P[pad_bounds[l]:] are the padding slots from block l on
    chunks: dict = field(default_factory=dict, repr=False, compare=False)  # _chunks, by size


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
    pad_P = free_P.nonzero().squeeze(1)
    pad_bounds = torch.searchsorted(pad_P, torch.arange(L + 1, device=dev) * b).tolist()
    lay = PaddedLayout(b, L, block_expert, slot_sorted.index_select(0, plan.inverse_N), pair_P,
                       pad_P, pad_bounds)
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


def _chunks(lay: PaddedLayout, row_bytes: int) -> list:
    """The blocks in chunks of at most ``CHUNK_BYTES`` on the wide side: (first block, end block,
    first slot, end slot, the chunk's padding slots relative to its first slot)."""
    L, b = lay.n_blocks, lay.block
    if L * b == 0:
        return []
    per = max(1, CHUNK_BYTES // (b * row_bytes))
    key = (per, lay.pad_P.device)
    chunks = lay.chunks.get(key)
    if chunks is None:
        chunks = []
        for l0 in range(0, L, per):
            l1 = min(L, l0 + per)
            pad = lay.pad_P[lay.pad_bounds[l0]:lay.pad_bounds[l1]] - l0 * b
            chunks.append((l0, l1, l0 * b, l1 * b, pad))
        lay.chunks[key] = chunks
    return chunks


def _block_weights(w_EDF, lay: PaddedLayout):
    return w_EDF if lay.block_expert is None else w_EDF.index_select(0, lay.block_expert)


def _gather_rows(x_MD: torch.Tensor, row_n: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """The rows of a chunk's slots, padding slots zeroed (so that not even a non-finite row 0
    reaches another row's output or a weight gradient)."""
    xs = x_MD.index_select(0, row_n)
    return xs.index_fill_(0, pad, 0) if pad.numel() else xs


def _row_dot(a_ND: torch.Tensor, b_ND: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """out[n] = a[n] · b[n], as N batched 1 x D x 1 products: unlike ``(a * b).sum(-1)`` (or
    ``linalg.vecdot``), no [N, D] temporary is written and read back."""
    D = a_ND.shape[1]
    return torch.bmm(a_ND.view(-1, 1, D), b_ND.view(-1, D, 1), out=out.view(-1, 1, 1))


class PaddedExpertMatmul(torch.autograd.Function):
    """y = expert matmul over the padded layout; same contract as the sorted implementations
    (module docstring of moeify.ops.expert_matmul). Inputs are pre-validated."""

    @staticmethod
    def forward(ctx, x_MD, w_EDF, gates_MK, lay: PaddedLayout, k: int, groups: int,
                sum_rows: int = 1):
        M, D = x_MD.shape
        Fo = w_EDF.shape[-1]
        b = lay.block
        row_P = torch.div(lay.pair_P, k, rounding_mode="floor")
        gated = gates_MK is not None
        gate_in = gated and D < Fo
        gate_P = gates_MK.reshape(-1).index_select(0, lay.pair_P).to(x_MD.dtype) if gated else None
        w_LDF = _block_weights(w_EDF, lay)
        grow_P = None
        if gated:
            # Output row of each slot: its row's group, or its block of R rows.
            if sum_rows > 1:
                grow_P = torch.div(lay.pair_P, k * sum_rows, rounding_mode="floor")
            else:
                grow_P = row_P * groups + torch.div(lay.pair_P % k, k // groups,
                                                    rounding_mode="floor")
            y = x_MD.new_zeros(M * groups // sum_rows, Fo)
        else:
            ys_PF = x_MD.new_empty(lay.n_blocks * b, Fo)
        for l0, l1, s0, s1, pad in _chunks(lay, max(D, Fo) * x_MD.element_size()):
            xs = _gather_rows(x_MD, row_P[s0:s1], pad)
            if gate_in:
                xs.mul_(gate_P[s0:s1, None])
            if not gated:  # padding slots are never read back
                torch.bmm(xs.view(l1 - l0, b, D), w_LDF[l0:l1],
                          out=ys_PF[s0:s1].view(l1 - l0, b, Fo))
                continue
            ys = torch.bmm(xs.view(l1 - l0, b, D), w_LDF[l0:l1]).view(s1 - s0, Fo)
            if not gate_in:
                ys.mul_(gate_P[s0:s1, None])
            y.index_add_(0, grow_P[s0:s1], ys)
        if gated:
            y = y.view(M, groups, Fo) if groups > 1 else y
        else:
            y = ys_PF.index_select(0, lay.slot_N).view(M, k, Fo)
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
        # Slot p receives the gradient of the output row it was summed into.
        g_src, g_row = ((grad_y.view(-1, Fo), grow_P) if gated
                        else (grad_y.view(M * k, Fo), lay.pair_P))
        w_LDF = _block_weights(w_EDF, lay)
        grad_x = x_MD.new_zeros(M, D) if need_x else None
        grad_g_P = x_MD.new_empty(L * b) if need_g else None
        grad_w = (w_LDF.new_empty if L * b else w_LDF.new_zeros)(L, D, Fo) if need_w else None
        for l0, l1, s0, s1, pad in _chunks(lay, max(D, Fo) * x_MD.element_size()):
            n, rows = l1 - l0, row_P[s0:s1]
            g = g_src.index_select(0, g_row[s0:s1])
            if pad.numel():  # zero gradient at the padding: no weight or input gradient
                g.index_fill_(0, pad, 0)
            xs = _gather_rows(x_MD, rows, pad) if need_g or need_w else None
            if need_x or need_g:
                # With either gate side, ga = g @ Wᵀ (the slot's output gradient before gating,
                # taken back through its expert) gives d/dgate = ga · xs and d/dxs = gate · ga:
                # the gate gradient needs no saved [P, F] outputs.
                ga = torch.bmm(g.view(n, b, Fo), w_LDF[l0:l1].transpose(1, 2)).view(s1 - s0, D)
                if need_g:
                    _row_dot(ga, xs, out=grad_g_P[s0:s1])
                if need_x:
                    if gated:
                        ga.mul_(gate_P[s0:s1, None])
                    grad_x.index_add_(0, rows, ga)
            if need_w:
                if gated:  # the gate on whichever side the forward applied it
                    (xs if gate_in else g).mul_(gate_P[s0:s1, None])
                torch.bmm(xs.view(n, b, D).transpose(1, 2), g.view(n, b, Fo), out=grad_w[l0:l1])
        if need_w and lay.block_expert is not None:
            grad_w = grad_w.new_zeros(E, D, Fo).index_add_(0, lay.block_expert, grad_w)
        grad_gates = None
        if need_g:
            grad_gates = grad_g_P.index_select(0, lay.slot_N).view(M, k).to(gate_dtype)
        return grad_x, grad_w, grad_gates, None, None, None, None
