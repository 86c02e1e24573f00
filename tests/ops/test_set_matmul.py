"""The expert-set layout's own parts (moeify.ops.moe.cpu.sets): the head-major order, the placement
of units in blocks of their set, the block plan, the layout's errors and the eligibility rule.
The expert-set matmul itself, against the definition with both gate sides and every output
contract, is in test_expert_matmul.py."""

import math

import pytest
import torch

from moeify.ops.moe.cpu.sets import (
    MAX_SETS,
    _plan_blocks,
    MIN_UNITS_PER_SET,
    head_major_order,
    set_layout,
    sets_eligible,
)
from references import routed_inputs

pytestmark = pytest.mark.usefixtures("single_thread")


def test_head_major_order_is_a_permutation_and_its_inverse():
    u_of_o, o_of_u = head_major_order(2 * 3 * 5, 3, 2, "cpu")
    assert sorted(u_of_o.tolist()) == list(range(30))
    assert torch.equal(o_of_u[u_of_o], torch.arange(30))
    # Output row (b=1, g=2, s=4) is unit (b·S + s)·G + g = (5 + 4)·3 + 2.
    assert int(u_of_o[(1 * 3 + 2) * 5 + 4]) == 29


def block_ids_of_slots(lay):
    """[P, K]: the weight matrices of the block each slot lies in (read off the grids)."""
    rows = [g.block_ids_LK.repeat_interleave(g.block, 0) for g in lay.grids]
    return torch.cat(rows) if rows else torch.zeros(0, lay.k, dtype=torch.long)


@pytest.mark.parametrize("skew", [False, True])
def test_layout_places_every_unit_once_in_a_block_of_its_set(skew):
    U, G, E, K = 400, 2, 5, 2
    _, ids, _, _ = routed_inputs(U, K, G * E, 1, 1, skew=skew, n_groups=G, gated=False)
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


