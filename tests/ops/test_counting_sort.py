"""The routing plan's counting sort (moeify.ops.moe.plan.counting_sort) against the stable
argsort it replaces on CUDA: the same order (ties in pair order) and its inverse, for balanced,
skewed, empty-expert and empty routings; and where the plan takes it.

Shape legend: N routed pairs, E experts."""

import pytest
import torch

from moeify.ops.moe.plan import (
    COUNTING_SORT_MAX_EXPERTS,
    RoutingPlan,
    counting_sort,
    uses_counting_sort,
)


@pytest.mark.parametrize("case", ["balanced", "skewed", "one-expert", "empty"])
@pytest.mark.parametrize("E", [1, 5, 10, 64])
def test_counting_sort_is_the_stable_argsort(case, E):
    g = torch.Generator().manual_seed(E)
    N = 0 if case == "empty" else 257
    flat_N = torch.randint(0, E, (N,), generator=g)
    if case == "skewed":
        flat_N[torch.rand(N, generator=g) < 0.7] = E - 1
    elif case == "one-expert":
        flat_N.fill_(E // 2)
    order, inverse = counting_sort(flat_N, E)
    want = torch.argsort(flat_N, stable=True)
    assert order.dtype == inverse.dtype == torch.int64
    assert torch.equal(order, want)
    assert torch.equal(inverse[want], torch.arange(N))


def test_the_plan_counts_on_cuda_for_few_experts_only(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert uses_counting_sort(cuda, 10) and uses_counting_sort(cuda, COUNTING_SORT_MAX_EXPERTS)
    assert not uses_counting_sort(cuda, COUNTING_SORT_MAX_EXPERTS + 1)
    assert not uses_counting_sort(cpu, 10)
    # A plan that counts (forced on CPU tensors) keeps the order and its inverse.
    monkeypatch.setattr("moeify.ops.moe.plan.uses_counting_sort", lambda device, E: True)
    flat_N = torch.tensor([3, 1, 3, 0, 1, 1, 2, 3])
    plan = RoutingPlan(flat_N, 4)
    assert plan.order_N.tolist() == [3, 1, 4, 5, 6, 0, 2, 7]
    assert plan.holds("inverse")  # computed with the order, not from it
    assert torch.equal(plan.inverse_N[plan.order_N], torch.arange(8))
