"""The variable-k expert MLP (moeify.ops.moe.pairs): flat (row, expert) pairs with per-row
counts, against the pair-by-pair definition (tests/references.py), outputs and every gradient,
in float64, for each kernel; the plan's per-row counts and offsets; bad input. The registered
op under torch.compile: tests/models/test_remoe_model.py."""

import pytest
import torch

from moeify.ops.moe import IMPLEMENTATIONS, make_pair_plan, mask_expert_mlp, pair_expert_mlp
from moeify.ops.moe.pairs import mask_pairs
from references import ref_varlen_expert_mlp

f64 = torch.float64
# Every built-in kernel but "sets" (sets of a fixed k: refused, tested below) and "triton" (CUDA,
# or its interpreter: tests/ops/test_triton_matmul.py).
KERNELS = [n for n in IMPLEMENTATIONS if n not in ("sets", "triton")] + ["auto"]


def varlen_inputs(M=23, E=5, D=6, G=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g, dtype=f64).requires_grad_()
    w1 = torch.randn(E, D, G, generator=g, dtype=f64).requires_grad_()
    w2 = torch.randn(E, G, D, generator=g, dtype=f64).requires_grad_()
    wu = torch.randn(E, D, G, generator=g, dtype=f64).requires_grad_()
    logits = torch.randn(M, E, generator=g, dtype=f64) - 0.3
    logits[3] = -1.0  # a row routed nowhere
    logits[5] = 1.0   # a row routed everywhere
    return x, w1, w2, wu, logits.requires_grad_()


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("gated", [False, True])
def test_matches_definition_with_every_gradient(impl, gated):
    x, w1, w2, wu, logits = varlen_inputs()
    gates = torch.relu(logits)
    counts = (gates > 0).sum(1)
    assert counts.min() == 0 and counts.max() == 5 and len(set(counts.tolist())) > 2
    up, act = (wu, "silu") if gated else (None, "relu")
    if impl == "grouped":  # grouped_mm has no float64: named, it raises (no substitute runs)
        with pytest.raises(ValueError, match="grouped_mm needs float32"):
            mask_expert_mlp(x, gates, w1, w2, w_up_EDG=up, activation=act, impl=impl)
        return
    y = mask_expert_mlp(x, gates, w1, w2, w_up_EDG=up, activation=act, impl=impl)
    ref = ref_varlen_expert_mlp(x, gates, w1, w2, up, act)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    inputs = [x, w1, w2, logits] + ([wu] if gated else [])
    g = torch.randn_like(ref)
    got = torch.autograd.grad(y, inputs, g, retain_graph=True)
    want = torch.autograd.grad(ref, inputs, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_float32_grouped_matches_definition():
    x, w1, w2, _, logits = (t.detach().float().requires_grad_()
                            for t in varlen_inputs(M=23, E=5, D=8, G=4))
    gates = torch.relu(logits)
    y = mask_expert_mlp(x, gates, w1, w2, impl="grouped")
    ref = ref_varlen_expert_mlp(x, gates, w1, w2)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(ref)
    inputs = [x, w1, w2, logits]
    for a, b in zip(torch.autograd.grad(y, inputs, g, retain_graph=True),
                    torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["segment", "padded", "reference"])
def test_no_pairs_at_all_gives_zeros_and_zero_gradients(impl):
    x, w1, w2, _, _ = varlen_inputs(M=8)
    gates = torch.zeros(8, 5, dtype=f64, requires_grad=True)
    y = mask_expert_mlp(x, gates, w1, w2, impl=impl)
    assert torch.equal(y, torch.zeros(8, 6, dtype=f64))
    gx, gw = torch.autograd.grad(y.sum(), [x, w1], allow_unused=True)
    assert gx is None or torch.equal(gx, torch.zeros_like(x))


def test_plan_counts_and_offsets():
    row = torch.tensor([0, 0, 2, 2, 2, 4])
    exp = torch.tensor([1, 3, 0, 1, 2, 3])
    plan = make_pair_plan(row, exp, 6, 4)
    assert plan.variable_k and plan.num_pairs == 6
    assert plan.row_counts_M.tolist() == [2, 0, 3, 0, 1, 0]
    assert plan.row_offsets_M.tolist() == [0, 2, 2, 5, 5, 6, 6]
    assert plan.counts_E.tolist() == [1, 2, 1, 2]
    gates = torch.zeros(6, 4)
    gates[row, exp] = torch.arange(1.0, 7.0)
    p2, gate_N = mask_pairs(gates)
    assert torch.equal(p2.row_N, row) and torch.equal(p2.flat_N, exp)
    assert gate_N.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_pair_lists_equal_the_mask_form():
    x, w1, w2, _, logits = varlen_inputs()
    gates = torch.relu(logits)
    plan, gate_N = mask_pairs(gates)
    y = pair_expert_mlp(x, plan, gate_N, w1, w2, impl="segment")
    torch.testing.assert_close(y, ref_varlen_expert_mlp(x, gates, w1, w2), rtol=1e-10,
                               atol=1e-10)


def test_bad_input_is_a_one_line_error():
    with pytest.raises(ValueError, match="non-decreasing"):
        make_pair_plan(torch.tensor([1, 0]), torch.tensor([0, 0]), 2, 2)
    with pytest.raises(ValueError, match="expert ids"):
        make_pair_plan(torch.tensor([0, 1]), torch.tensor([0, 5]), 2, 2)
    x, w1, w2, _, logits = varlen_inputs()
    with pytest.raises(ValueError, match="gates must be"):
        mask_expert_mlp(x, logits[:, :3], w1, w2)
    with pytest.raises(ValueError, match="sets"):
        mask_expert_mlp(x, torch.relu(logits), w1, w2, impl="sets")
    plan, gate_N = mask_pairs(torch.relu(logits))
    with pytest.raises(ValueError, match="activation"):
        pair_expert_mlp(x, plan, gate_N, w1, w2, activation="tanh")
