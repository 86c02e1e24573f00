"""The fast paths against their references, outputs and every gradient: the padded expert matmul
(forced, whatever the padding), the per-row-group sums of the expert matmul, the fused
Transformer-XL attention core and the RoPE rotation.

Shape legend: M rows, K experts per row, E experts, D input width, F output width, B batch,
H heads, T queries, S keys, C head channels, R relative distances.
"""

import math

import pytest
import torch

from moeify.ops.attention import attend, build_mask
from moeify.ops.expert_matmul import IMPLEMENTATIONS, chosen_impl, expert_matmul, make_plan
from moeify.ops.padded_matmul import (
    CAPACITY_SLACK,
    SINGLE_THREAD_SLACK,
    padded_layout,
    padding_pays,
    slot_sums,
)
from moeify.ops.positional import (
    apply_rope,
    rel_shift,
    sinusoidal_embedding,
    xl_logits_contiguous,
    xl_position_table,
)
from moeify.ops.xl_attention import xl_attention
from references import ref_expert_rows as naive_rows
from references import ref_rope as brute_rope
from references import routed_inputs

f64 = torch.float64


pytestmark = pytest.mark.usefixtures("single_thread")


def grads(y, inputs, g):
    return torch.autograd.grad((y * g).sum(), inputs, allow_unused=True)


def assert_all_close(a, b, rtol=1e-10, atol=1e-10):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------- expert matmul


def routed(M, K, E, D, F, *, seed=0, skew=False, gated=True):
    """references.routed_inputs in float64, with gradients on x, w and the gates."""
    x, idx, w, gates = routed_inputs(M, K, E, D, F, seed=seed, skew=skew, gated=gated)
    return (x.requires_grad_(), idx, w.requires_grad_(),
            None if gates is None else gates.requires_grad_())


@pytest.mark.parametrize("D,F", [(12, 5), (5, 12)])  # gates on the outputs / on the inputs
@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("gated,groups", [(False, 1), (True, 1), (True, 2)])
def test_padded_matches_naive(D, F, skew, gated, groups):
    x, idx, w, gates = routed(17, 4, 6, D, F, skew=skew, gated=gated)
    inputs = [t for t in (x, w, gates) if t is not None]
    y = expert_matmul(x, idx, w, gates, groups=groups, impl="padded")
    ref = naive_rows(x, idx, w, gates, groups)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)
    assert_all_close(grads(y, inputs, g), grads(ref, inputs, g))


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


@pytest.mark.parametrize("gated,groups,sum_rows", [(False, 1, 1), (True, 1, 1), (True, 2, 1),
                                                   (True, 1, 3)])
def test_padded_in_bfloat16_matches_float64(gated, groups, sum_rows):
    # bfloat16 on CPU takes the fallback sums: same results to bfloat16 accuracy.
    x, idx, w, gates = routed(18, 4, 6, 8, 5, skew=True, gated=gated, seed=3)
    tensors = [t for t in (x, w, gates) if t is not None]
    low = [t.detach().to(torch.bfloat16).requires_grad_() for t in tensors]
    y = expert_matmul(low[0], idx, low[1], low[2] if gated else None, groups=groups,
                      sum_rows=sum_rows, impl="padded")
    xs = [t.detach().to(torch.bfloat16).to(f64).requires_grad_() for t in tensors]
    ref = naive_rows(xs[0], idx, xs[1], xs[2] if gated else None, groups, sum_rows)
    torch.testing.assert_close(y.to(f64), ref, rtol=3e-2, atol=3e-2)
    g = torch.randn_like(ref)
    for a, b in zip(grads(y, low, g.to(torch.bfloat16)), grads(ref, xs, g)):
        torch.testing.assert_close(a.to(f64), b, rtol=5e-2, atol=5e-2)


def test_padding_never_leaks_a_non_finite_row():
    # Padding slots must not carry row 0 into other rows' outputs or any weight gradient.
    x, idx, w, gates = routed(9, 2, 4, 5, 3, seed=4)
    assert padded_layout(make_plan(idx, 4)).pad_P.numel() > 0
    x0 = x.detach().clone()
    x0[0] = float("inf")
    x0.requires_grad_()
    y = expert_matmul(x0, idx, w, gates, impl="padded")
    assert torch.isfinite(y[1:]).all()
    y[1:].sum().backward()
    others = torch.ones(4, dtype=torch.bool).index_fill_(0, idx[0], False)  # not row 0's experts
    assert others.any() and torch.isfinite(w.grad[others]).all()
    assert torch.isfinite(x0.grad[1:]).all()


def test_padded_gradcheck_and_empty_input():
    x, idx, w, gates = routed(6, 2, 3, 4, 5)
    f = lambda x, w, g: expert_matmul(x, idx, w, g, impl="padded")  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, w, gates))
    x0 = torch.zeros(0, 4, dtype=f64, requires_grad=True)
    y = expert_matmul(x0, torch.zeros(0, 2, dtype=torch.long), w, torch.zeros(0, 2, dtype=f64),
                      impl="padded")
    y.sum().backward()
    assert y.shape == (0, 5) and x0.grad.shape == (0, 4)


@pytest.mark.parametrize("skew", [False, True])
def test_padded_layout_places_every_pair_once(skew):
    _, idx, _, _ = routed(40, 3, 5, 4, 4, skew=skew)
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


def test_auto_pads_only_when_padding_is_small():
    _, skewed, _, _ = routed(64, 1, 8, 4, 4, skew=True)
    even = make_plan(torch.arange(64).remainder(4)[:, None], 4)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert not padding_pays(make_plan(skewed, 8))  # 8 x 64 slots for 64 pairs
        assert padding_pays(even) and 4 * 16 <= SINGLE_THREAD_SLACK * 64
        torch.set_num_threads(2)
        assert padding_pays(make_plan(skewed, 8))  # threaded: always, blocks bound the padding
        x, w = torch.zeros(64, 4), torch.zeros(8, 4, 4)
        assert chosen_impl("auto", x, skewed, w) == "padded"  # what reports name
        torch.set_num_threads(1)
        assert chosen_impl("auto", x, skewed, w) == "segment"
        assert chosen_impl("gather", x, skewed, w) == "gather"
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("impl", ["auto", "padded"] + [i for i in IMPLEMENTATIONS if i != "sets"])
def test_sum_rows_sums_consecutive_rows(impl):
    # SwitchHead's output experts: rows are (token, head), one output per token.
    x, idx, w, gates = routed(12, 2, 5, 6, 9)
    y = expert_matmul(x, idx, w, gates, sum_rows=3, impl=impl)
    ref = naive_rows(x, idx, w, gates, sum_rows=3)
    assert y.shape == (4, 9)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)
    assert_all_close(grads(y, (x, w, gates), g), grads(ref, (x, w, gates), g))


def test_sum_rows_validation():
    x, idx, w, gates = routed(6, 2, 3, 4, 4)
    with pytest.raises(ValueError, match="sum_rows"):
        expert_matmul(x, idx, w, gates, sum_rows=4)
    with pytest.raises(ValueError, match="sum_rows"):
        expert_matmul(x, idx, w, None, sum_rows=2)
    with pytest.raises(ValueError, match="sum_rows"):
        expert_matmul(x, idx, w, gates, groups=2, sum_rows=2)


def test_plan_shared_by_two_row_groupings_with_padding():
    # One [M, H, k] selection serves value experts ([M, H*k], groups=H) and output experts
    # ([M*H, k] rows summed over the H heads of a token), as SwitchHead with a shared selection.
    M, H, k, E = 7, 2, 2, 4
    g = torch.Generator().manual_seed(5)
    ids = torch.rand(M, H, E, generator=g).topk(k, -1).indices + torch.arange(H)[:, None] * E
    gates = torch.rand(M, H, k, generator=g, dtype=f64)
    plan = make_plan(ids, H * E)
    xv = torch.randn(M, 6, dtype=f64)
    wv = torch.randn(H * E, 6, 3, dtype=f64)
    v = expert_matmul(xv, ids.view(M, H * k), wv, gates.view(M, H * k), groups=H,
                      impl="padded", plan=plan)
    torch.testing.assert_close(v, naive_rows(xv, ids.view(M, H * k), wv, gates.view(M, H * k),
                                             groups=H))
    xo = torch.randn(M * H, 3, dtype=f64)
    wo = torch.randn(H * E, 3, 6, dtype=f64)
    o = expert_matmul(xo, ids.view(M * H, k), wo, gates.view(M * H, k), sum_rows=H,
                      impl="padded", plan=plan)
    torch.testing.assert_close(o, naive_rows(xo, ids.view(M * H, k), wo, gates.view(M * H, k),
                                             sum_rows=H))


# ---------------------------------------------------------------------------- XL core


def reference_xl(qc, qp, k, v, w_pos, mask, causal, S):
    """The unfused path: explicit softmax with the shifted position logits as an additive bias."""
    bias = xl_logits_contiguous(qp, w_pos, S, causal=causal)
    return attend(qc, k, v, mask, scale=1.0, bias_BHTS=bias, impl="reference")


XL_CASES = {
    "causal_square": dict(T=5, S=5, causal=True),
    "causal_memory": dict(T=4, S=9, causal=True),
    "more_queries_than_keys": dict(T=6, S=3, causal=True),
    "cross": dict(T=4, S=6, causal=False),
    "valid_keys_with_empty_rows": dict(T=5, S=5, causal=True, valid=True),
}


@pytest.mark.parametrize("case", list(XL_CASES))
@pytest.mark.parametrize("Hk,Hp", [(3, 3), (1, 1), (3, 1)])
def test_fused_xl_matches_reference(case, Hk, Hp):
    spec = XL_CASES[case]
    torch.manual_seed(0)
    B, H, C, D, T, S = 2, 3, 4, 8, spec["T"], spec["S"]
    qc = torch.randn(B, H, T, C, dtype=f64, requires_grad=True)
    qp = torch.randn(B, H, T, C, dtype=f64, requires_grad=True)
    k = torch.randn(B, Hk, S, C, dtype=f64, requires_grad=True)
    v = torch.randn(B, Hk, S, C, dtype=f64, requires_grad=True)
    w_pos = torch.randn(D, Hp, C, dtype=f64, requires_grad=True)
    valid = None
    if spec.get("valid"):
        valid = torch.tensor([[False, False, True, True, False], [True] * 5])
    mask = build_mask(T, S, causal=spec["causal"], valid_k_BS=valid)
    p = xl_position_table(w_pos, S, T, causal=spec["causal"], dtype=f64)
    out = xl_attention(qc, qp, k, v, p, allowed_BTS=mask.allowed_BTS,
                       causal_square=mask.causal_square)
    if mask.nonempty_BT is not None:
        out = out * mask.nonempty_BT[:, None, :, None].to(out.dtype)
    ref = reference_xl(qc, qp, k, v, w_pos, mask, spec["causal"], S)
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-12)
    g = torch.randn_like(ref)
    inputs = (qc, qp, k, v, w_pos)
    assert_all_close(grads(out, inputs, g), grads(ref, inputs, g))


def test_fused_xl_gradcheck_with_shared_query():
    # SwitchHead passes the same tensor as content and position query.
    torch.manual_seed(1)
    q = torch.randn(1, 2, 3, 2, dtype=f64, requires_grad=True)
    k = torch.randn(1, 2, 5, 2, dtype=f64, requires_grad=True)
    v = torch.randn(1, 2, 5, 2, dtype=f64, requires_grad=True)
    p = torch.randn(2, 5, 2, dtype=f64, requires_grad=True)
    mask = build_mask(3, 5, causal=True)
    f = lambda q, k, v, p: xl_attention(q, q, k, v, p, allowed_BTS=mask.allowed_BTS)  # noqa
    assert torch.autograd.gradcheck(f, (q, k, v, p))


def test_fused_xl_follows_autocast():
    torch.manual_seed(4)
    q = torch.randn(2, 2, 4, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    p = torch.randn(2, 6, 8)
    mask = build_mask(4, 6, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = xl_attention(q, q, k, v, p, allowed_BTS=mask.allowed_BTS)
    assert out.dtype == torch.bfloat16
    bias = rel_shift(q.double() @ p.double().transpose(-1, -2), 6)
    want = attend(q.double(), k.double(), v.double(), mask, scale=1.0, bias_BHTS=bias,
                  impl="reference")
    torch.testing.assert_close(out.double(), want, rtol=0, atol=5e-2)
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_fused_xl_rejects_a_short_table():
    q = torch.randn(1, 1, 3, 2)
    with pytest.raises(ValueError, match="position table"):
        xl_attention(q, q, torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2),
                     torch.randn(1, 4, 2))


def test_position_table_rows_are_projected_distances():
    torch.manual_seed(2)
    w = torch.randn(6, 2, 3, dtype=f64)
    p = xl_position_table(w, 4, 3, causal=False, dtype=f64)
    dist = torch.arange(3, -3, -1)  # S-1 down to 1-T
    want = torch.einsum("rd,dhc->hrc", sinusoidal_embedding(dist, 6, f64), w)
    torch.testing.assert_close(p, want)
    # rel_shift of the product with it is the classic XL position logit.
    q = torch.randn(1, 2, 3, 3, dtype=f64)
    torch.testing.assert_close(rel_shift(q @ p.transpose(-1, -2), 4),
                               xl_logits_contiguous(q, w, 4, causal=False))


# ---------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("C,n_rot", [(8, 4), (6, 6), (9, 0)])
def test_rope_gradients_match_complex_rotation(C, n_rot):
    torch.manual_seed(3)
    x = torch.randn(2, 3, 5, 16, dtype=f64)[..., :C].transpose(1, 2)  # non-contiguous
    x.requires_grad_()
    pos = torch.randint(0, 1000, (2, 3))
    out = apply_rope(x, pos, n_rot=n_rot)
    ref = brute_rope(x, pos, n_rot)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)
    assert_all_close(grads(out, (x,), g), grads(ref, (x,), g), rtol=1e-12, atol=1e-12)


def test_rope_gradcheck():
    x = torch.randn(1, 2, 3, 6, dtype=f64, requires_grad=True)
    pos = torch.tensor([[0, 5, 9]])
    assert torch.autograd.gradcheck(lambda x: apply_rope(x, pos, n_rot=4), (x,))


def test_rope_scale_reference_unchanged():
    # The rotation preserves norms of the rotated pairs (a property, independent of the code).
    x = torch.randn(1, 1, 4, 8, dtype=f64)
    out = apply_rope(x, torch.tensor([[3, 1, 4, 1]]), n_rot=8)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
    assert math.isfinite(out.sum().item())
