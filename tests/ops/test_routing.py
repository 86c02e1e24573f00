"""Routing ops against independent brute-force definitions."""

import math

import pytest
import torch

from moeify.ops.routing import (
    capacity_mask,
    expert_capacity,
    expert_choice,
    expert_choice_count,
    router_logits,
    sigmoid_topk,
    softmax_topk,
)


def test_sigmoid_topk_is_float32_unrenormalised_and_differentiable():
    # Distinct logits exactly representable in bfloat16: random bf16 values tie often (8-bit
    # mantissa), and a tie makes the top-k membership ambiguous.
    g = torch.Generator().manual_seed(0)
    values = (torch.randperm(30, generator=g).float() - 15.0) / 4.0
    logits = values.view(6, 5).to(torch.bfloat16).requires_grad_()
    r = sigmoid_topk(logits, 2)
    assert r.gates.dtype == torch.float32 and r.idx.dtype == torch.int64
    s = torch.sigmoid(logits.detach().float())
    for m in range(6):
        want = sorted(range(5), key=lambda e: -s[m, e].item())[:2]
        assert set(r.idx[m].tolist()) == set(want)
        assert torch.equal(r.gates[m].detach(), s[m, r.idx[m]])
    assert not torch.allclose(r.gates.sum(-1), torch.ones(6))  # raw sigmoid values
    r.gates.sum().backward()
    assert logits.grad is not None and (logits.grad != 0).sum() == 12  # only chosen experts


def test_softmax_topk_and_renormalisation():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    r = softmax_topk(logits, 3)
    p = torch.softmax(logits.detach(), -1)
    assert r.scores.dtype == torch.float32
    assert torch.allclose(r.scores, p.float())
    for m in range(4):  # the three most probable experts, by brute force
        want = sorted(range(6), key=lambda e: -p[m, e].item())[:3]
        assert set(r.idx[m].tolist()) == set(want)
        assert torch.allclose(r.gates[m], p[m, r.idx[m]].float())
    # Gates are differentiable through the full softmax: d gate_i / d logit_j = p_i (δij - p_j).
    r.gates[0].sum().backward()
    chosen = torch.zeros(6, dtype=torch.float64)
    chosen[r.idx[0]] = 1.0
    p0 = p[0]
    want_grad = p0 * chosen - p0 * (p0 * chosen).sum()
    torch.testing.assert_close(logits.grad[0], want_grad, rtol=1e-5, atol=1e-6)
    rn = softmax_topk(logits, 3, renormalize=True)
    assert torch.allclose(rn.gates.sum(-1), torch.ones(4))
    torch.testing.assert_close(rn.gates, r.gates.detach() / r.gates.detach().sum(-1, keepdim=True))


def test_softmax_exclude_keeps_the_full_softmax():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    r = softmax_topk(logits, 2, exclude=torch.tensor([[True, False, False, False]]))
    assert sorted(r.idx[0].tolist()) == [1, 2]
    p = torch.softmax(logits, -1)  # an excluded expert still counts in the normaliser
    torch.testing.assert_close(r.gates.sort(-1, descending=True).values, p[:, 1:3])


def test_exclude_removes_experts_from_choice():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    r = sigmoid_topk(logits, 2, exclude=torch.tensor([[True, False, False, False]]))
    assert sorted(r.idx[0].tolist()) == [1, 2]


@pytest.mark.parametrize("k", [0, 5])
def test_k_out_of_range(k):
    with pytest.raises(ValueError, match="k must lie in"):
        sigmoid_topk(torch.randn(2, 4), k)


def test_expert_choice_count_is_ceil():
    assert expert_choice_count(256, 0.125) == 32
    assert expert_choice_count(10, 0.125) == 2  # ceil(1.25)
    assert expert_choice_count(3, 0.1) == 1
    assert expert_choice_count(7, 1.0) == 7
    with pytest.raises(ValueError):
        expert_choice_count(8, 0.0)


def test_expert_choice_picks_top_positions_in_order():
    scores = torch.randn(3, 16)
    idx, sel = expert_choice(scores, 0.25)
    assert idx.shape == (3, 4) and sel.sum(1).tolist() == [4, 4, 4]
    for b in range(3):
        want = sorted(torch.argsort(scores[b], descending=True)[:4].tolist())
        assert idx[b].tolist() == want
        assert sel[b].nonzero().flatten().tolist() == want


def test_expert_choice_skips_invalid_positions():
    scores = torch.arange(8.0).repeat(2, 1)
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[0, 6:] = False
    idx, _ = expert_choice(scores, 0.25, valid_BS=valid)
    assert idx[0].tolist() == [4, 5] and idx[1].tolist() == [6, 7]


def test_expert_choice_capacity_follows_each_rows_valid_length():
    # A padded row routes as it would unpadded: ceil(capacity * its valid tokens), not of S.
    scores = torch.tensor([[5.0, 1, 4, 2, 9, 8, 7, 6], [5.0, 1, 4, 2, 9, 8, 7, 6]])
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 4:] = False  # 4 real tokens
    idx, sel = expert_choice(scores, 0.5, valid_BS=valid)
    assert idx.shape == (2, 4)
    assert sel[0].nonzero().flatten().tolist() == [4, 5, 6, 7]
    assert sel[1].nonzero().flatten().tolist() == [0, 2]  # top-2 of the first four
    assert idx[1].tolist() == sorted(idx[1].tolist())  # columns stay in position order


def brute_capacity(idx, E, cap, valid=None):
    M, K = idx.shape
    used = [0] * E
    keep = torch.zeros(M, K, dtype=torch.bool)
    for k in range(K):  # all first choices before second choices
        for m in range(M):  # earlier tokens first
            if valid is not None and not valid[m]:
                continue
            e = int(idx[m, k])
            if used[e] < cap:
                used[e] += 1
                keep[m, k] = True
    return keep


@pytest.mark.parametrize("K", [1, 2])
def test_capacity_mask_position_priority(K):
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(30)])
    idx[:20, 0] = 1  # skew: expert 1 overflows
    valid = torch.rand(30, generator=g) > 0.2
    for cap in (1, 5, 9, 100):
        assert torch.equal(capacity_mask(idx, 4, cap), brute_capacity(idx, 4, cap))
        assert torch.equal(capacity_mask(idx, 4, cap, valid_M=valid),
                           brute_capacity(idx, 4, cap, valid))


def test_expert_capacity():
    assert expert_capacity(1024, 8, 1.0) == 128
    assert expert_capacity(1000, 8, 1.25) == math.ceil(1000 / 8 * 1.25)
    assert expert_capacity(100, 4, 1.0, k=2) == 50
    with pytest.raises(ValueError):
        expert_capacity(10, 2, 0.0)


def test_router_logits_stay_float32_under_autocast():
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    w, b = torch.randn(8, 32), torch.randn(8)
    want = (x.double() @ w.double().T + b.double()).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.nn.functional.linear(x, w).dtype == torch.bfloat16  # what a Linear does
        got = router_logits(x, w, b)
        got_bf16_input = router_logits(x.bfloat16(), w)
    assert got.dtype == torch.float32 and got_bf16_input.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_bf16_input, x.bfloat16().float() @ w.T, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- ties


def _by_score_then_id(row, k):
    """The definition of the tie-break: largest score first, equal scores by lowest index."""
    return sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]


@pytest.mark.parametrize("route", [sigmoid_topk, softmax_topk])
def test_tied_scores_go_to_the_lowest_expert_id_largest_first(route):
    # Logits on a coarse grid of 3 values over 8 experts: nearly every row has ties at the cut.
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-1, 2, (64, 8), generator=g).float()
    top = route(logits, 3)
    scores = top.scores.tolist()
    for m in range(64):
        assert top.idx[m].tolist() == _by_score_then_id(scores[m], 3), m
    # A router that starts at zero (MoA) ties every expert: every token takes experts 0..k-1.
    assert route(torch.zeros(5, 6), 2).idx.tolist() == [[0, 1]] * 5


def test_excluded_experts_are_skipped_by_the_tie_break():
    exclude = torch.tensor([[True, False, True, False, False]])
    assert sigmoid_topk(torch.zeros(1, 5), 2, exclude=exclude).idx.tolist() == [[1, 3]]


def test_expert_choice_ties_keep_the_earliest_positions():
    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    idx, selected = expert_choice(scores, 0.5)  # 4 of 8: the two 1s, then positions 0 and 2
    assert idx.tolist() == [[0, 1, 2, 4]]
    valid = torch.tensor([[False, True, True, True, True, True, True, True]])
    idx, selected = expert_choice(scores, 0.5, valid_BS=valid)  # 4 of 7 valid: 1, 4, 2, 3
    assert selected[0].nonzero().view(-1).tolist() == [1, 2, 3, 4]

