"""The routing plan: the routed (row, expert) pairs of one routing, sorted by expert once.

Shape legend: M rows, K experts per row, E experts, N = M · K routed pairs (fixed k), or
any number of pairs given as flat (row, expert) lists (variable k: ``make_pair_plan``).

A plan is built once per routing (``make_plan``) and shared by every expert matmul that uses
that routing (SwitchHead's V and K experts, or O and Q; an expert MLP's two matmuls), also when
those matmuls view the same ids with different row groupings. The sort by expert is a
counting sort on CUDA for a few experts (``counting_sort``: one scan of an [E, N] indicator
instead of a radix sort's passes; metadata costs as much as the GEMMs at small scale), a stable
argsort elsewhere. Everything on it is computed on
first use and kept, the layouts that kernels derive from it included (``RoutingPlan.cached``):
a kernel that never needs the sort by expert never pays for it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from moeify.ops.routing import count_ids

# The sort by expert is a counting sort on CUDA up to this many experts (module docstring): its
# [E, N] int32 scan stays small, and one scan replaces a radix sort's passes.
COUNTING_SORT_MAX_EXPERTS = 64


def uses_counting_sort(device: torch.device, num_experts: int) -> bool:
    """Whether a plan on ``device`` sorts its pairs by counting (CUDA, few experts) rather than
    by a stable argsort. On the CPU the argsort measured as fast or faster."""
    return device.type == "cuda" and num_experts <= COUNTING_SORT_MAX_EXPERTS


def counting_sort(flat_N: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_N, inverse_N): the stable sort of the pairs by expert, and each pair's sorted
    position, by counting: pair n of expert e goes to start[e] + (the pairs of e before n),
    read off one inclusive scan of the [E, N] indicator. No comparison sort, no host sync,
    shapes fixed by N and E. ``torch.argsort(flat_N, stable=True)`` is the reference."""
    N = flat_N.shape[0]
    hits_EN = (flat_N[None, :] == torch.arange(num_experts, device=flat_N.device)[:, None])
    seen_EN = hits_EN.to(torch.int32).cumsum(1)  # pairs of expert e among the first n + 1
    counts_E = seen_EN[:, -1] if N else seen_EN.new_zeros(num_experts)
    first_E = counts_E.cumsum(0) - counts_E  # sorted position of each expert's first pair
    inverse_N = (seen_EN + (first_E - 1)[:, None]).gather(0, flat_N[None, :]).view(N).long()
    order_N = torch.empty_like(inverse_N).scatter_(
        0, inverse_N, torch.arange(N, device=flat_N.device))
    return order_N, inverse_N


class RoutingPlan:
    """Routed pairs sorted by expert (module docstring).

    The pairs are the flattened ids, idx.reshape(-1) (``flat_N``); ``order_N`` lists pair
    indices in expert order (stable, so ties keep row order) and ``inverse_N`` maps a pair back
    to its sorted position; ``counts_E`` [E] (int64, on the device) counts the pairs per expert
    and ``offsets_E`` (int32) is its cumulative sum; ``counts()`` is the same counts read back
    to the host, once (a host sync on accelerators: for kernels that size work on the host).

    ``group_size``: the experts come in groups of that many consecutive ids, and a row's
    experts of one group form a set (SwitchHead: the E experts of each head); None: no groups.

    Variable k (``make_pair_plan``): ``row_N`` (int64 [N], non-decreasing) gives the row of
    each pair, so a row has any number of experts, none included; ``row_offsets_M`` [M + 1]
    (int64) are the cumulative per-row counts ``row_counts_M`` [M]: row m's pairs are
    ``row_offsets_M[m]:row_offsets_M[m + 1]``. A fixed-k plan has ``row_N`` None (pair n
    belongs to row n // K).
    """

    def __init__(self, flat_N: torch.Tensor, num_experts: int, group_size: int | None = None,
                 row_N: torch.Tensor | None = None, n_rows: int | None = None):
        self.num_experts = num_experts
        self.group_size = group_size
        self.flat_N = flat_N  # int64 [N]: the expert of each pair
        self.row_N = row_N  # int64 [N]: the row of each pair (variable k), else None
        self.n_rows = n_rows  # M (variable k), else None
        self._memo: dict = {}

    @property
    def variable_k(self) -> bool:
        return self.row_N is not None

    @property
    def row_counts_M(self) -> torch.Tensor:
        """int64 [M]: the pairs (experts) of each row (variable k only)."""
        return self.cached("row_counts", lambda: count_ids(self.row_N, self.n_rows))

    @property
    def row_offsets_M(self) -> torch.Tensor:
        """int64 [M + 1]: where each row's pairs start, and N at the end (variable k only)."""
        return self.cached("row_offsets", lambda: torch.nn.functional.pad(
            torch.cumsum(self.row_counts_M, 0), (1, 0)))

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()``, computed on the first call with this key and kept on the plan: the
        layouts and host-side numbers that kernels derive from the routing."""
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = build()
        return v

    def holds(self, key: Any) -> bool:
        """Whether ``cached`` has built ``key`` on this plan (which layouts a call used)."""
        return key in self._memo

    @property
    def num_pairs(self) -> int:
        return self.flat_N.shape[0]

    @property
    def device(self) -> torch.device:
        return self.flat_N.device

    @property
    def order_N(self) -> torch.Tensor:
        if uses_counting_sort(self.device, self.num_experts) and not self.holds("order"):
            order, inverse = counting_sort(self.flat_N, self.num_experts)
            self._memo["inverse"] = inverse
            return self.cached("order", lambda: order)
        return self.cached("order", lambda: torch.argsort(self.flat_N, stable=True))

    @property
    def inverse_N(self) -> torch.Tensor:
        def inverse():
            order = self.order_N
            return torch.empty_like(order).index_copy_(
                0, order, torch.arange(order.numel(), device=order.device))
        return self.cached("inverse", inverse)

    @property
    def counts_E(self) -> torch.Tensor:
        return self.cached("counts", lambda: count_ids(self.flat_N, self.num_experts))

    @property
    def offsets_E(self) -> torch.Tensor:
        return self.cached("offsets", lambda: torch.cumsum(self.counts_E, 0).to(torch.int32))

    def counts(self) -> list[int]:
        """The pairs per expert on the host (one read-back, then kept)."""
        return self.cached("counts_host", lambda: self.counts_E.tolist())

    def max_count(self) -> int:
        """The largest expert's number of pairs (0 without pairs), on the host."""
        return self.cached("max_count", lambda: max(self.counts(), default=0))


def check_ids(idx: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError unless ``idx`` holds integer expert ids in [0, num_experts). On CPU the
    range is read back; on accelerators a device-side assertion fires asynchronously instead
    (no host sync), as it does for fake tensors, which have no values to read (the cost
    contract counts whole training steps under them: moeify.bench.contract)."""
    if idx.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise ValueError(f"expert ids must be an integer tensor, got dtype {idx.dtype}")
    compiling = torch.compiler.is_compiling()
    if not compiling and idx.numel() == 0:  # compiled, numel may be an unbacked symbol
        return                              # (expert parallelism): the assertion takes 0 ids
    if idx.device.type == "cpu" and not compiling and not is_fake(idx):
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
        torch._assert_async(((idx >= 0) & (idx < num_experts)).all(), "expert id out of range")


def make_plan(idx: torch.Tensor, num_experts: int, *, group_size: int | None = None,
              in_range: bool = False) -> RoutingPlan:
    """The routing of ``idx`` (any shape; flattened) as a RoutingPlan. ``group_size``: the
    experts form groups of that many consecutive ids. ``in_range``: the caller built the ids in
    [0, num_experts) itself (a top-k over that many scores, plus group offsets), so the range
    check is skipped (on CPU it reads the ids' range back to the host; on accelerators it is an
    asynchronous device-side assertion)."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if group_size is not None and (group_size < 1 or num_experts % group_size):
        raise ValueError(f"group_size={group_size} must be a positive divisor of "
                         f"num_experts={num_experts}")
    if not in_range:
        check_ids(idx, num_experts)
    return RoutingPlan(idx.reshape(-1).to(torch.int64), num_experts, group_size)


def make_pair_plan(row_N: torch.Tensor, expert_N: torch.Tensor, n_rows: int, num_experts: int,
                   *, in_range: bool = False) -> RoutingPlan:
    """Variable k: the routed pairs as flat lists, pair n routing row ``row_N[n]`` to expert
    ``expert_N[n]``, the pairs in row order (``row_N`` non-decreasing, as ``nonzero`` of a
    [M, E] mask returns them). A row may have any number of pairs, zero included.
    ``in_range``: the caller built both lists itself (from a mask of [n_rows, num_experts]),
    so the checks are skipped."""
    if num_experts <= 0 or n_rows < 0:
        raise ValueError(f"num_experts must be positive and n_rows non-negative, got "
                         f"{num_experts} and {n_rows}")
    if row_N.dim() != 1 or expert_N.shape != row_N.shape:
        raise ValueError(f"row_N and expert_N must be two 1-d tensors of one length, got "
                         f"shapes {tuple(row_N.shape)} and {tuple(expert_N.shape)}")
    if not in_range:
        check_ids(expert_N, num_experts)
        check_ids(row_N, max(n_rows, 1))
        if row_N.numel() > 1:
            ordered = (row_N[1:] >= row_N[:-1]).all()
            if row_N.device.type == "cpu" and not torch.compiler.is_compiling():
                if not bool(ordered):
                    raise ValueError("row_N must be non-decreasing (the pairs in row order, as "
                                     "nonzero() of a [rows, experts] mask gives them)")
            else:
                torch._assert_async(ordered, "row_N must be non-decreasing")
    return RoutingPlan(expert_N.to(torch.int64), num_experts, None, row_N.to(torch.int64),
                       n_rows)


__all__ = ["COUNTING_SORT_MAX_EXPERTS", "RoutingPlan", "check_ids", "counting_sort",
           "make_pair_plan", "make_plan", "uses_counting_sort"]
