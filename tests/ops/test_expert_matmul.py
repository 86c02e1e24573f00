"""The expert matmul: every implementation against a deliberately naive loop, outputs and all
gradients, plus the edge cases and input validation."""

import pytest
import torch

from moeify.ops.expert_matmul import IMPLEMENTATIONS, expert_matmul, make_plan
from references import ref_expert_rows as naive
from references import routed_inputs as make


def run(impl, x, idx, w, gates, groups=1, grad_out=None):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    gates = None if gates is None else gates.clone().requires_grad_()
    y = expert_matmul(x, idx, w, gates, impl=impl, groups=groups)
    go = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype) \
        if grad_out is None else grad_out
    y.backward(go)
    return y.detach(), x.grad, w.grad, None if gates is None else gates.grad


def assert_close(a, b, rtol):
    scale = b.abs().max().clamp_min(1e-12)
    assert ((a.double() - b.double()).abs().max() / scale).item() < rtol


def check_against_naive(impl, x, idx, w, gates, groups=1, rtol=1e-10):
    got = run(impl, x, idx, w, gates, groups)
    xr = x.clone().double().requires_grad_()
    wr = w.clone().double().requires_grad_()
    gr = None if gates is None else gates.clone().double().requires_grad_()
    want = naive(xr, idx, wr, gr, groups)
    want.backward(torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
                  .to(got[0].dtype).double())
    for a, b in zip(got, (want.detach(), xr.grad, wr.grad, None if gr is None else gr.grad)):
        if b is None:
            assert a is None
        else:
            assert a.shape == b.shape
            assert_close(a, b, rtol)


# "sets" needs grouped routing and gates: tests/test_set_matmul.py.
ALL = ("reference",) + tuple(i for i in IMPLEMENTATIONS if i not in ("reference", "sets")) \
    + ("auto",)


@pytest.mark.parametrize("impl", ALL)
@pytest.mark.parametrize("gated", [False, True])
def test_float64_matches_naive(impl, gated):
    x, idx, w, gates = make(13, 3, 5, 7, 6, gated=gated)
    check_against_naive(impl, x, idx, w, gates)


@pytest.mark.parametrize("impl", ALL)
def test_float32_matches_naive(impl):
    x, idx, w, gates = make(64, 2, 8, 32, 16, dtype=torch.float32)
    check_against_naive(impl, x, idx, w, gates, rtol=1e-5)


@pytest.mark.parametrize("impl", ALL)
def test_groups_give_per_group_sums(impl):
    # SwitchHead's value experts: K = heads * k, one gated sum per head.
    x, idx, w, gates = make(9, 6, 10, 8, 4)
    check_against_naive(impl, x, idx, w, gates, groups=3)


def test_reference_gradcheck():
    x, idx, w, gates = make(5, 2, 3, 4, 3)
    f = lambda x, w, g: expert_matmul(x, idx, w, g, impl="reference")  # noqa: E731
    assert torch.autograd.gradcheck(f, (x.requires_grad_(), w.requires_grad_(),
                                        gates.double().requires_grad_()))


@pytest.mark.parametrize("impl", ["segment", "grouped"])
def test_sorted_gradcheck(impl):
    x, idx, w, gates = make(6, 2, 3, 4, 4)
    f = lambda x, w, g: expert_matmul(x, idx, w, g, impl=impl)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x.requires_grad_(), w.requires_grad_(),
                                        gates.double().requires_grad_()))


EDGE_CASES = {
    "expert without rows": dict(M=10, K=1, E=4, D=8, F=8, idx=torch.tensor([[0], [2]] * 5)),
    "all rows to one expert": dict(M=10, K=1, E=4, D=8, F=8, idx=torch.full((10, 1), 3)),
    "K equals E": dict(M=7, K=4, E=4, D=8, F=8),
    "one expert": dict(M=7, K=1, E=1, D=8, F=8),
    "one row": dict(M=1, K=2, E=5, D=8, F=8),
    "D and F not multiples of 4": dict(M=11, K=2, E=3, D=7, F=5),
    "no rows": dict(M=0, K=2, E=3, D=8, F=8),
}


@pytest.mark.parametrize("impl", ALL)
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_cases(impl, case):
    c = dict(EDGE_CASES[case])
    x, idx, w, gates = make(c["M"], c["K"], c["E"], c["D"], c["F"], idx=c.get("idx"))
    if c["M"] == 0:
        y, gx, gw, gg = run(impl, x, idx, w, gates)
        assert y.shape == (0, c["F"]) and gx.shape == x.shape and (gw == 0).all()
        return
    check_against_naive(impl, x, idx, w, gates)
    # float32 too, where grouped_mm's alignment constraints bite
    check_against_naive(impl, x.float(), idx, w.float(), gates, rtol=1e-5)


@pytest.mark.parametrize("impl", ALL)
def test_bfloat16(impl):
    x, idx, w, gates = make(32, 2, 4, 16, 16, dtype=torch.bfloat16)
    y, gx, gw, gg = run(impl, x, idx, w, gates)
    assert y.dtype == gx.dtype == gw.dtype == torch.bfloat16
    want = naive(x.double(), idx, w.double(), gates.double())
    assert_close(y, want, 2e-2)


@pytest.mark.parametrize("impl", ALL)
def test_non_contiguous_inputs(impl):
    x, idx, w, gates = make(12, 2, 4, 16, 8, dtype=torch.float32)
    x_nc = torch.cat([x, x], 1)[:, ::2]  # stride 2 along D
    w_nc = w.transpose(1, 2).contiguous().transpose(1, 2)  # column-major expert matrices
    idx_nc = torch.cat([idx, idx], 0)[::2]
    assert not x_nc.is_contiguous() and not w_nc.is_contiguous()
    check_against_naive(impl, x_nc, idx_nc, w_nc, gates[:, :].t().contiguous().t(), rtol=1e-5)


@pytest.mark.parametrize("impl", ALL)
def test_stride_zero_gradient(impl):
    # y.sum().backward() hands the backward an expanded (stride-0) gradient.
    x, idx, w, gates = make(16, 2, 4, 16, 16, dtype=torch.float32)
    for g in (None, gates):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        expert_matmul(xr, idx, wr, g, impl=impl).sum().backward()
        xd, wd = x.clone().double().requires_grad_(), w.clone().double().requires_grad_()
        naive(xd, idx, wd, None if g is None else g.double()).sum().backward()
        assert_close(xr.grad, xd.grad, 1e-5)
        assert_close(wr.grad, wd.grad, 1e-5)


def test_plan_is_reusable_across_row_groupings():
    # One sort of [M, H, k] ids serves a [M, H*k] view (value experts) and a [M*H, k] view
    # (output experts), as SwitchHead's Q and O experts share a selection.
    x, idx, w, gates = make(8, 6, 12, 8, 4)
    plan = make_plan(idx, 12)
    a = expert_matmul(x, idx, w, gates, groups=3, impl="segment", plan=plan)
    assert_close(a, naive(x, idx, w, gates, groups=3), 1e-12)
    xo = torch.randn(24, 8, dtype=torch.float64)
    io, go = idx.reshape(24, 2), gates.reshape(24, 2)
    b = expert_matmul(xo, io, w, go, impl="segment", plan=plan)
    assert_close(b, naive(xo, io, w, go), 1e-12)


def test_ids_get_no_gradient_and_all_impls_agree_on_auto():
    x, idx, w, gates = make(8, 2, 4, 8, 8, dtype=torch.float32)
    assert not idx.is_floating_point()
    y = expert_matmul(x, idx, w, gates)
    assert y.shape == (8, 8)


@pytest.mark.parametrize("impl", ALL)
def test_invalid_input_raises_value_error(impl):
    x, idx, w, gates = make(4, 2, 3, 8, 8)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        expert_matmul(x, idx + 3, w, impl=impl)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        expert_matmul(x, idx - 1, w, impl=impl)
    with pytest.raises(ValueError, match="integer"):
        expert_matmul(x, idx.double(), w, impl=impl)
    with pytest.raises(ValueError, match="idx must be"):
        expert_matmul(x, idx[:3], w, impl=impl)
    with pytest.raises(ValueError, match="w must be"):
        expert_matmul(x, idx, w[:, :5], impl=impl)
    with pytest.raises(ValueError, match="gates must"):
        expert_matmul(x, idx, w, gates[:, :1], impl=impl)
    with pytest.raises(ValueError, match="groups"):
        expert_matmul(x, idx, w, gates, groups=3, impl=impl)
    with pytest.raises(ValueError, match="dtype"):
        expert_matmul(x.float(), idx, w, impl=impl)


def test_unknown_implementation():
    x, idx, w, _ = make(4, 2, 3, 8, 8)
    with pytest.raises(ValueError, match="unknown expert-matmul implementation"):
        expert_matmul(x, idx, w, impl="fastest")


def test_plan_mismatch_raises():
    x, idx, w, _ = make(4, 2, 3, 8, 8)
    with pytest.raises(ValueError, match="plan was built"):
        expert_matmul(x, idx, w, impl="segment", plan=make_plan(idx[:2], 3))


@pytest.mark.parametrize("impl", ALL)
def test_autocast_runs_in_the_autocast_dtype(impl):
    x, idx, w, gates = make(16, 2, 4, 16, 16, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = expert_matmul(x, idx, w, gates, impl=impl)
    assert y.dtype == torch.bfloat16
    assert_close(y, naive(x.double(), idx, w.double(), gates.double()), 2e-2)
