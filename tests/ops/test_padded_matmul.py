"""The padded layout's own parts (moeify.ops.moe.cpu.padded): the slot sums against a loop and the
layout's placement of the routed pairs. The padded expert matmul itself, against the definition,
is in test_expert_matmul.py.

Shape legend: M rows, K experts per row, E experts, N = M·K pairs, P slots.
"""

import pytest
import torch

from moeify.ops.moe import expert_matmul, make_plan
from moeify.ops.moe.cpu.padded import CAPACITY_SLACK, padded_layout
from moeify.ops.moe.layout import slot_sums
from references import routed_inputs

f64 = torch.float64
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("dtype", [f64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("path", ["embedding_bag", "fallback"])
def test_slot_sums_match_a_loop(dtype, weighted, path, monkeypatch):
    # The bag sum and the gather-and-sum fallback (taken where embedding_bag has no kernel)
    # against the definition, one output row at a time.
    if path == "fallback":
        def no_kernel(*args, **kwargs):
            raise NotImplementedError("no embedding_bag kernel")
        monkeypatch.setattr(torch.nn.functional, "embedding_bag", no_kernel)
    g = torch.Generator().manual_seed(0)
    P, F, per_row, n_out = 11, 4, 3, 3
    src = torch.randn(P, F, generator=g, dtype=f64)
    slot = torch.randperm(P, generator=g)[: n_out * per_row]
    weight = torch.rand(n_out * per_row, generator=g, dtype=f64)
    out = slot_sums(src.to(dtype), slot, weight.to(dtype) if weighted else None, per_row)
    ref = torch.stack([sum((weight[n] if weighted else 1.0) * src[slot[n]]
                           for n in range(r * per_row, (r + 1) * per_row))
                       for r in range(n_out)])
    assert out.dtype == dtype
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.to(f64), ref, **tol)


@pytest.mark.parametrize("skew", [False, True])
def test_padded_layout_places_every_pair_once(skew):
    _, idx, _, _ = routed_inputs(40, 3, 5, 4, 4, skew=skew)
    plan = make_plan(idx, 5)
    lay = padded_layout(plan)
    counts = torch.bincount(idx.reshape(-1), minlength=5)
    N, P = idx.numel(), lay.n_blocks * lay.block
    if lay.block_expert is None:  # one block per expert, as long as the largest expert
        assert lay.block == int(counts.max()) and 5 * lay.block <= CAPACITY_SLACK * N
        expert_of_block = torch.arange(5)
    else:  # bounded padding whatever the routing
        assert skew and P <= 1.25 * N + 5 * 8
        expert_of_block = lay.block_expert
    # Each pair's slot lies in a block of its expert, no two pairs share a slot, the rest pads.
    assert torch.equal(expert_of_block[lay.slot_N // lay.block], idx.reshape(-1))
    assert torch.equal(lay.pair_P[lay.slot_N], torch.arange(N))
    assert sorted(lay.pad_P.tolist() + lay.slot_N.tolist()) == list(range(P))
    assert padded_layout(plan) is lay  # computed once per plan


@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("D,F", [(6, 3), (3, 6)])
@pytest.mark.parametrize("wanted", ["xwg", "wg", "xg", "g", "xw"])
def test_backward_of_any_input_subset_equals_the_definition(skew, D, F, wanted):
    # The backward takes the gate gradient on the narrower side (ga · xs or g · xs W), reuses
    # its buffers, and skips what is not asked for: every subset of (x, w, gates) against the
    # reference's gradients, both layouts, D < F and D > F.
    from moeify.ops.moe import expert_matmul

    x, idx, w, gates = routed_inputs(30, 2, 5, D, F, skew=skew)
    g = torch.randn(30, F, generator=torch.Generator().manual_seed(1), dtype=f64)
    grads = {}
    for impl in ("padded", "reference"):
        leaves = [t.clone().requires_grad_(n in wanted) for t, n in zip((x, w, gates), "xwg")]
        y = expert_matmul(leaves[0], idx, leaves[1], leaves[2], impl=impl,
                          plan=make_plan(idx, 5))
        grads[impl] = torch.autograd.grad((y * g).sum(), [t for t in leaves if t.requires_grad])
    assert (padded_layout(make_plan(idx, 5)).block_expert is not None) == skew
    for a, r in zip(grads["padded"], grads["reference"]):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("path", ["embedding_bag", "fallback"])
@pytest.mark.parametrize("L", [0, 1, 13])
def test_sum_by_id_equals_index_add(path, L, monkeypatch):
    # Per-block weight gradients summed into their experts: the index_add it stands for, with
    # experts that get no block, repeated ids and no blocks at all.
    from moeify.ops.moe.layout import sum_by_id

    if path == "fallback":
        def no_kernel(*args, **kwargs):
            raise NotImplementedError("no embedding_bag kernel")
        monkeypatch.setattr(torch.nn.functional, "embedding_bag", no_kernel)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(L, 3, 5, generator=g)
    ids = torch.randint(0, 4, (L,), generator=g) * 2  # odd experts never occur
    out = sum_by_id(src, ids, 9)
    ref = torch.zeros(9, 3, 5).index_add_(0, ids, src)
    assert out.shape == (9, 3, 5)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(out[1::2]) == 0


def test_a_plan_is_freed_by_reference_counting_alone():
    """A layout refers to its plan weakly (the plan keeps its layouts): with the cyclic
    collector off, a plan, its sort and its layouts go as soon as nothing uses them, and the
    padded kernel's backward (which reads only its blocks) does not keep the plan alive."""
    import gc
    import weakref

    x, idx, w, gates = routed_inputs(24, 2, 4, 8, 6, dtype=torch.float64)
    xs, ws = x.requires_grad_(), w.requires_grad_()
    was = gc.isenabled()
    gc.disable()
    try:
        plan = make_plan(idx, 4)
        y = expert_matmul(xs, idx, ws, gates, impl="padded", plan=plan)
        ref = weakref.ref(plan)
        del plan
        assert ref() is None  # freed after the forward
        y.sum().backward()
        plan = make_plan(idx, 4)
        y = expert_matmul(xs, idx, ws, gates, impl="segment", plan=plan)
        ref = weakref.ref(plan)
        del plan
        assert ref() is not None  # held for the segment kernel's backward
        y.sum().backward()
        del y
        assert ref() is None
    finally:
        if was:
            gc.enable()
