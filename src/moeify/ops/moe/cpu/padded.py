"""The padded layout: every expert's rows in one batched matmul.

Shape legend: N routed pairs, E experts, L blocks, b rows per block, P = L · b slots.

The routed pairs, sorted by expert, are cut into blocks of b rows, each block holding pairs of
a single expert (an expert's last block is padded). One ``torch.bmm`` over [L, b, D] x
[L, D, F] then does every expert's work, where the per-expert loop ("segment") issues E
matmuls. Each matmul is its own parallel region; with several threads a region costs a thread
wake-up (microseconds on an idle machine, milliseconds on a busy one), so one region instead of
E pays for some padding. Two layouts:

    capacity  one block per expert, b = the largest expert's count: no weight copies, used when
              that wastes at most ``CAPACITY_SLACK`` (balanced routing);
    blocked   b = ceil(N / (4E)) rounded up to 8, so padding is at most a quarter of N however
              unbalanced the routing; the weights are gathered per block ([L, D, F]) and their
              gradient summed back per expert (``sum_by_id``).

Padding slots hold zero rows (``gather_rows``) and receive a zero output gradient, so they
contribute nothing to any output or weight gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeify.ops.moe.layout import SlotLayout, slot_sums, sum_by_id
from moeify.ops.moe.registry import ExpertKernel, register

# Largest padding (padded slots / routed pairs) for which one block per expert is used.
CAPACITY_SLACK = 1.25


@dataclass(frozen=True, eq=False)
class PaddedLayout(SlotLayout):
    """The [L, b] grid of blocks (module docstring)."""

    block: int = 0  # b
    n_blocks: int = 0  # L
    block_expert: torch.Tensor | None = None  # int64 [L]: expert of each block; None: block e


def blocked_block(n_items: int, n_groups: int) -> int:
    """Block height of the blocked layout: n_items / (4 · n_groups) rounded up to a multiple of
    8, so that padding is at most a quarter of the items however unbalanced the groups."""
    return 8 * math.ceil(n_items / (32 * n_groups))


def padded_layout(plan) -> PaddedLayout:
    """The padded layout of a RoutingPlan, computed once per plan (cached on it)."""
    return plan.cached("padded_layout", lambda: _build(plan))


def _build(plan) -> PaddedLayout:
    E, N = plan.num_experts, plan.num_pairs
    counts_E = plan.counts_E
    dev = counts_E.device
    cap = plan.max_count()
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
    return PaddedLayout(plan, P, pair_P, slot_sorted.index_select(0, plan.inverse_N),
                        free_P.nonzero().squeeze(1), block=b, n_blocks=L,
                        block_expert=block_expert)


def block_weights(w_EAB: torch.Tensor, lay: PaddedLayout) -> torch.Tensor:
    """Each block's matrix: w itself (block e = expert e), or gathered per block."""
    return w_EAB if lay.block_expert is None else w_EAB.index_select(0, lay.block_expert)


class PaddedKernel(ExpertKernel):
    name = "padded"
    keeps_narrow_products = False  # nothing [P, ·] kept between the passes
    reads_plan = False  # the blocks are all the backward reads

    def layout(self, plan):
        return padded_layout(plan)

    def forward(self, a, w_EAB, lay, k=None):
        a_PA = self.slot_rows(a, lay, k)
        L, b = lay.n_blocks, lay.block
        B = w_EAB.shape[-1]
        return torch.bmm(a_PA.view(L, b, a_PA.shape[1]), block_weights(w_EAB, lay)).view(L * b, B)

    def input_grad(self, g_PB, w_EAB, lay, k=None, n_rows=0):
        # The block weights gathered as stored, then read transposed by the bmm (gathering the
        # transposed view would copy it strided).
        L, b = lay.n_blocks, lay.block
        A = w_EAB.shape[1]
        ga = torch.bmm(g_PB.reshape(L, b, g_PB.shape[1]),
                       block_weights(w_EAB, lay).transpose(1, 2)).view(L * b, A)
        return ga if k is None else slot_sums(ga, lay.slot_N, None, k)

    def weight_grad(self, a, g_PB, lay, n_experts, k=None):
        a_PA = self.slot_rows(a, lay, k)
        L, b = lay.n_blocks, lay.block
        gw = torch.bmm(a_PA.view(L, b, a_PA.shape[1]).transpose(1, 2),
                       g_PB.reshape(L, b, g_PB.shape[1]))
        return gw if lay.block_expert is None else sum_by_id(gw, lay.block_expert, n_experts)


register(PaddedKernel())
