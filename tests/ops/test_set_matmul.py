"""The expert-set matmul (moeify.ops.set_matmul) against the pair-by-pair definition: outputs and
every gradient, both gate sides, both output contracts, balanced and skewed routing, plus its
layout, eligibility and validation."""

import math

import pytest
import torch

from moeify.ops.expert_matmul import chosen_impl, expert_matmul, make_plan
from moeify.ops.set_matmul import (
    MAX_SETS,
    _plan_blocks,
    MIN_UNITS_PER_SET,
    head_major_order,
    set_layout,
    sets_eligible,
)
from references import ref_expert_rows

f64 = torch.float64
pytestmark = pytest.mark.usefixtures("single_thread")


def grouped_routing(U, G, E, K, *, seed=0, skew=False):
    """[U, K] ids g·E + e: unit u belongs to group u % G and picks K distinct experts of it."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(U, E, generator=g)
    if skew:  # experts 0 and 1 win almost everywhere: one set dominates, the others pad
        scores[:, :2] += 0.9
    local = scores.topk(K, -1).indices
    return local + (torch.arange(U) % G)[:, None] * E


def operands(M, D, F, X, gate_cols, seed=1, dtype=f64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g, dtype=f64).to(dtype).requires_grad_()
    w = torch.randn(X, D, F, generator=g, dtype=f64).to(dtype).requires_grad_()
    gates = torch.rand(M, gate_cols, generator=g, dtype=f64).requires_grad_()
    return x, w, gates


def grads(y, inputs, g):
    return torch.autograd.grad((y * g).sum(), inputs)


def assert_matches(y, ref, inputs, rtol=1e-12, atol=1e-12):
    torch.testing.assert_close(y, ref, rtol=rtol, atol=atol)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=ref.dtype)
    for a, b in zip(grads(y, inputs, g.to(y.dtype)), grads(ref, inputs, g)):
        torch.testing.assert_close(a.to(b.dtype), b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("D,F", [(12, 5), (5, 12)])  # gates on the output / on the input
@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("G,E,K", [(2, 5, 2), (3, 4, 3), (1, 6, 1), (2, 4, 4)])
def test_groups_contract_matches_pairs(D, F, skew, G, E, K):
    # SwitchHead's V / K experts: rows are tokens, each token's G groups of K experts.
    M = 40
    ids_UK = grouped_routing(M * G, G, E, K, skew=skew)
    ids = ids_UK.view(M, G * K)
    x, w, gates = operands(M, D, F, G * E, G * K)
    plan = make_plan(ids, G * E, group_size=E)
    y = expert_matmul(x, ids, w, gates, groups=G, impl="sets", plan=plan)
    assert_matches(y, ref_expert_rows(x, ids, w, gates, groups=G), (x, w, gates))


@pytest.mark.parametrize("D,F", [(12, 5), (5, 12)])
@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("R,E,K", [(2, 5, 2), (3, 4, 3), (1, 5, 2)])
def test_sum_rows_contract_matches_pairs(D, F, skew, R, E, K):
    # SwitchHead's O / Q experts: rows are (token, head), the heads of a token summed.
    M = 36 * R
    ids = grouped_routing(M, R, E, K, skew=skew)
    x, w, gates = operands(M, D, F, R * E, K)
    plan = make_plan(ids, R * E, group_size=E)
    y = expert_matmul(x, ids, w, gates, sum_rows=R, impl="sets", plan=plan)
    assert_matches(y, ref_expert_rows(x, ids, w, gates, sum_rows=R), (x, w, gates))


@pytest.mark.parametrize("D,F", [(12, 5), (5, 12)])
def test_head_major_output(D, F):
    B, S, G, E, K = 3, 14, 2, 5, 2
    M = B * S
    ids = grouped_routing(M * G, G, E, K, seed=3).view(M, G * K)
    x, w, gates = operands(M, D, F, G * E, G * K)
    plan = make_plan(ids, G * E, group_size=E)
    y = expert_matmul(x, ids, w, gates, groups=G, impl="sets", plan=plan, batch=B)
    assert y.shape == (B, G, S, F) and y.is_contiguous()
    ref = ref_expert_rows(x, ids, w, gates, groups=G).view(B, S, G, F).transpose(1, 2)
    assert_matches(y, ref, (x, w, gates))
    # Other implementations give the same layout as a view.
    y2 = expert_matmul(x, ids, w, gates, groups=G, impl="padded", plan=plan, batch=B)
    torch.testing.assert_close(y2, ref, rtol=1e-12, atol=1e-12)


def test_head_major_order_is_a_permutation_and_its_inverse():
    u_of_o, o_of_u = head_major_order(2 * 3 * 5, 3, 2, "cpu")
    assert sorted(u_of_o.tolist()) == list(range(30))
    assert torch.equal(o_of_u[u_of_o], torch.arange(30))
    # Output row (b=1, g=2, s=4) is unit (b·S + s)·G + g = (5 + 4)·3 + 2.
    assert int(u_of_o[(1 * 3 + 2) * 5 + 4]) == 29


def test_bfloat16_matches_float64():
    M, G, E, K, D, F = 48, 2, 5, 2, 16, 8
    ids = grouped_routing(M * G, G, E, K).view(M, G * K)
    x, w, gates = operands(M, D, F, G * E, G * K)
    plan = make_plan(ids, G * E, group_size=E)
    xb, wb = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    gb = gates.detach().float().requires_grad_()
    y = expert_matmul(xb, ids, wb, gb, groups=G, impl="sets", plan=plan)
    ref = ref_expert_rows(x, ids, w, gates, groups=G)
    def close(a, b):  # bfloat16 keeps 8 bits: within 2% of the largest entry
        assert (a.double() - b).abs().max() <= 0.02 * b.abs().max()

    close(y, ref)
    g = torch.randn(ref.shape, dtype=f64)
    for a, b in zip(grads(y, (xb, wb, gb), g.bfloat16()), grads(ref, (x, w, gates), g)):
        close(a, b)


@pytest.mark.parametrize("D,F", [(6, 3), (3, 6)])
def test_padding_never_leaks_a_non_finite_row(D, F):
    M, G, E, K = 30, 1, 4, 2
    ids = grouped_routing(M, G, E, K, seed=5, skew=True)
    assert set_layout(ids, E).pad_P.numel() > 0
    x, w, gates = operands(M, D, F, E, K)
    x0 = x.detach().clone()
    x0[0] = float("inf")
    x0.requires_grad_()
    plan = make_plan(ids, E, group_size=E)
    y = expert_matmul(x0, ids, w, gates, impl="sets", plan=plan)
    assert torch.isfinite(y[1:]).all()
    y[1:].sum().backward()
    others = torch.ones(E, dtype=torch.bool).index_fill_(0, ids[0], False)
    assert torch.isfinite(w.grad[others]).all()
    assert torch.isfinite(x0.grad[1:]).all() and torch.isfinite(gates.grad[1:]).all()


def test_gradcheck():
    M, G, E, K = 10, 2, 3, 2
    ids = grouped_routing(M * G, G, E, K).view(M, G * K)
    plan = make_plan(ids, G * E, group_size=E)
    for D, F in ((4, 3), (3, 4)):
        x, w, gates = operands(M, D, F, G * E, G * K)
        f = lambda x, w, g: expert_matmul(x, ids, w, g, groups=G, impl="sets",  # noqa: E731
                                          plan=plan)
        assert torch.autograd.gradcheck(f, (x, w, gates))
    # No rows at all: empty results and gradients, in both output layouts.
    x0 = torch.zeros(0, 4, dtype=f64, requires_grad=True)
    w = torch.randn(G * E, 4, 3, dtype=f64, requires_grad=True)
    none = torch.zeros(0, G * K, dtype=torch.long)
    empty_plan = make_plan(none, G * E, group_size=E)
    y = expert_matmul(x0, none, w, torch.zeros(0, G * K, dtype=f64), groups=G, impl="sets",
                      plan=empty_plan)
    y.sum().backward()
    assert y.shape == (0, G, 3) and x0.grad.shape == (0, 4)
    assert expert_matmul(x0, none, w, torch.zeros(0, G * K, dtype=f64), groups=G, impl="sets",
                         plan=empty_plan, batch=1).shape == (1, G, 0, 3)


def block_ids_of_slots(lay):
    """[P, K]: the weight matrices of the block each slot lies in (read off the grids)."""
    rows = [g.block_ids_LK.repeat_interleave(g.block, 0) for g in lay.grids]
    return torch.cat(rows) if rows else torch.zeros(0, lay.k, dtype=torch.long)


@pytest.mark.parametrize("skew", [False, True])
def test_layout_places_every_unit_once_in_a_block_of_its_set(skew):
    U, G, E, K = 400, 2, 5, 2
    ids = grouped_routing(U, G, E, K, skew=skew)
    lay = set_layout(ids, E)
    # The block a unit sits in multiplies by exactly the unit's experts, ascending.
    assert torch.equal(block_ids_of_slots(lay)[lay.slot_U], ids.sort(-1).values)
    assert torch.equal(lay.pair_P[lay.slot_U], torch.arange(U))
    assert sorted(lay.pad_P.tolist() + lay.slot_U.tolist()) == list(range(lay.n_slots))
    assert torch.equal(ids.gather(1, lay.perm_UK), ids.sort(-1).values)
    assert lay.n_slots <= 1.25 * U + 2 * G * math.comb(E, K) * 8  # padding stays bounded


def test_block_plan_balances_padding_against_blocks():
    # Balanced counts around 400: a first grid of 400 and a low second grid for the overflow
    # pad far less than one block per set as tall as the largest.
    counts = [400 + d for d in (-30, -12, -5, 0, 3, 8, 11, 19, 25, 48)]
    kind, b1, b2 = _plan_blocks(counts)
    assert kind == "grids" and b1 < max(counts) and b1 + b2 == max(counts)
    slots = len(counts) * b1 + sum(1 for n in counts if n > b1) * b2
    assert slots < len(counts) * max(counts)
    # All equal: one grid, no padding.
    assert _plan_blocks([64] * 6) == ("grids", 64, 0)
    # One set with almost everything: the second grid holds its overflow alone.
    assert _plan_blocks([5000, 3, 2, 1, 4, 2]) == ("grids", 4, 4996)
    # Many sets of very different sizes: equal blocks bound the padding.
    kind, b, _ = _plan_blocks([1000, 700, 500, 300, 10, 5])
    assert kind == "blocked" and b % 8 == 0
    assert _plan_blocks([0, 0]) == ("grids", 0, 0)


def test_two_grids_match_pairs():
    # Five sets of 100 units and one of 180: two grids (100 high, then 80 for the big set's
    # overflow) instead of six blocks of 180; outputs and gradients still exact.
    E, K = 4, 2
    sets = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]])
    counts = torch.tensor([100, 100, 100, 100, 100, 180])
    ids = sets.repeat_interleave(counts, 0)
    ids = ids[torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(2))]
    ids = torch.where(torch.rand(ids.shape[0], 1) < 0.5, ids, ids.flip(1))  # any expert order
    lay = set_layout(ids, E)
    assert [(g.n_blocks, g.block) for g in lay.grids] == [(6, 100), (1, 80)]
    assert lay.n_slots == ids.shape[0]  # no padding at all
    for D, F in ((9, 4), (4, 9)):
        x, w, gates = operands(ids.shape[0], D, F, E, K)
        plan = make_plan(ids, E, group_size=E)
        y = expert_matmul(x, ids, w, gates, impl="sets", plan=plan)
        assert_matches(y, ref_expert_rows(x, ids, w, gates), (x, w, gates))


def test_layout_rejects_units_that_span_groups_or_repeat_an_expert():
    with pytest.raises(ValueError, match="one group"):
        set_layout(torch.tensor([[0, 5]]), 5)
    with pytest.raises(ValueError, match="distinct"):
        set_layout(torch.tensor([[1, 1]]), 5)


def test_eligibility():
    assert sets_eligible(10_000, 5, 2, 2)  # SwitchHead 47M: 10 sets per head
    assert not sets_eligible(10_000, None, 2, 2)  # no groups known
    assert not sets_eligible(10_000, 5, 2, 1)  # one expert per unit: the padded layout
    assert not sets_eligible(10_000, 5, 2, 5)  # every expert: dense
    assert not sets_eligible(4000, 5, 2, 2)  # 200 units per block: padding costs more
    assert sets_eligible(20 * MIN_UNITS_PER_SET, 5, 2, 2)
    assert math.comb(16, 4) > MAX_SETS and not sets_eligible(10**7, 16, 1, 4)


def test_auto_takes_sets_on_cpu_for_grouped_plans_only():
    M, G, E, K = 4000, 2, 5, 2
    ids = grouped_routing(M * G, G, E, K).view(M, G * K)
    x, w, gates = operands(M, 8, 4, G * E, G * K, dtype=torch.float32)
    grouped = make_plan(ids, G * E, group_size=E)
    plain = make_plan(ids, G * E)
    y = expert_matmul(x, ids, w, gates, groups=G, plan=grouped)
    assert ("sets", K) in grouped._cache  # the set layout was built and used
    expert_matmul(x, ids, w, gates, groups=G, plan=plain)
    assert ("sets", K) not in plain._cache
    torch.testing.assert_close(y, expert_matmul(x, ids, w, gates, groups=G, impl="reference"))
    # What reports name (moeify bench expert-matmul): rows = units here.
    units = ids.view(M * G, K)
    xu, wu = torch.zeros(M * G, 8), torch.zeros(G * E, 8, 4)
    assert chosen_impl("auto", xu, units, wu, group_size=E) == "sets"
    assert chosen_impl("auto", xu, units, wu) != "sets"
    assert chosen_impl("auto", xu[:100], units[:100], wu, group_size=E) != "sets"


def test_sets_needs_gates_and_a_grouped_plan():
    ids = grouped_routing(20, 1, 4, 2)
    x, w, gates = operands(20, 3, 3, 4, 2)
    with pytest.raises(ValueError, match="group_size"):
        expert_matmul(x, ids, w, gates, impl="sets", plan=make_plan(ids, 4))
    with pytest.raises(ValueError, match="gates"):
        expert_matmul(x, ids, w, None, impl="sets", plan=make_plan(ids, 4, group_size=4))
    with pytest.raises(ValueError, match="group_size"):
        make_plan(ids, 4, group_size=3)
