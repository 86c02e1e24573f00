"""Every custom autograd Function in moeify.ops under autocast (moeify.ops.amp's rule).

On CUDA, autocast runs ``sum``, ``softmax``, ``exp`` and other reductions in float32; on the CPU
it keeps bf16. ``amp_policy.cuda_autocast_policy`` applies CUDA's float32 list on the CPU, so
these tests meet what a GPU run meets: a Function whose forward returned float32 while it saved
bf16 operands failed in its backward (``expected m1 and m2 to have the same dtype``), which is
how SwitchHead, MoA and SwitchAll could not train in bf16 on CUDA.

Three checks: (1) the policy itself promotes as CUDA does; (2) every expert-matmul
implementation and output contract, the expert MLP, XL attention, the dropouts and RoPE under
CPU autocast with CUDA's policy: the autocast dtype out, every gradient close to the float64
definition; (3) each Function's backward handed a gradient of another dtype than its operands
(its graph node called directly, as autograd's own casts cannot be relied on) returns gradients
in the operands' dtypes, equal to those of a gradient of the right dtype. (The Triton kernels'
Function is held to the same rule in tests/ops/test_triton_matmul.py, in Triton's interpreter.)
"""

import pytest
import torch

from amp_policy import cuda_autocast_policy
from moeify.ops.dropout import dropout, relu_dropout
from moeify.ops.moe import IMPLEMENTATIONS, expert_matmul, make_plan
from moeify.ops.moe import expert_mlp
from moeify.ops.positional import apply_rope
from moeify.ops.xl_attention import xl_attention
from references import ref_expert_mlp, ref_expert_rows, routed_inputs

f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
BF16_TOL = 3e-2  # largest error over the largest reference entry


def _rel_err(got, want):
    return ((got.double() - want.double()).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def test_the_policy_promotes_what_cuda_autocast_promotes():
    x = torch.randn(4, 6, dtype=bf16)
    with cuda_autocast_policy() as policy:
        assert x.sum(1).dtype == bf16  # autocast off: nothing changes
        with torch.autocast("cpu", dtype=bf16):
            assert x.sum(1).dtype == f32
            assert torch.softmax(x, -1).dtype == f32
            assert (x @ x.t()).dtype == bf16  # matmuls keep the autocast dtype
            assert x.clone().exp_().dtype == bf16  # in-place ops are never autocast
    assert policy.seen == 2


# ---------------------------------------------------------------------------- expert matmul

CONTRACTS = {  # (M, G, R, k, gated): output [M, K, F], [M, F], [M, G, F], [M/R, F], batch
    "rows": (12, 1, 1, 2, False), "sum": (12, 1, 1, 2, True), "groups": (12, 2, 1, 2, True),
    "sum_rows": (12, 1, 2, 2, True), "batch": (12, 2, 1, 2, True)}


def _contract(name, D=16, F=8, E=4):
    M, G, R, k, gated = CONTRACTS[name]
    n = max(G, R)
    x, idx, w, gates = routed_inputs(M, G * k, n * E, D, F, dtype=f32, gated=gated,
                                     n_groups=n, unit=k)
    kw = dict(groups=G, sum_rows=R, batch=3 if name == "batch" else None)
    return x, idx, w, gates, make_plan(idx, n * E, group_size=E), kw


def _ref_matmul(x, idx, w, gates, groups, sum_rows, batch):
    y = ref_expert_rows(x, idx, w, gates, groups, sum_rows)
    return y if batch is None else y.view(batch, -1, groups, y.shape[-1]).transpose(1, 2)


# Every implementation but the CUDA kernels (their own tests run them in Triton's interpreter)
# with every contract it serves ("sets" is gated only).
MATMUL_CASES = [(impl, c) for impl in [i for i in IMPLEMENTATIONS if i != "triton"] + ["auto"]
                for c in CONTRACTS if not (impl == "sets" and not CONTRACTS[c][4])]


@pytest.mark.parametrize("impl,contract", MATMUL_CASES)
def test_expert_matmul_under_cuda_autocast(impl, contract):
    x, idx, w, gates, plan, kw = _contract(contract)
    leaves = [t.requires_grad_() for t in (x, w, gates) if t is not None]
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=bf16):
        y = expert_matmul(x, idx, w, gates, impl=impl, plan=plan, **kw)
    assert y.dtype == bf16
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(y, leaves, g.to(bf16))
    refs = [t.detach().double().requires_grad_() for t in leaves]
    want = _ref_matmul(refs[0], idx, refs[1], refs[2] if gates is not None else None, **kw)
    assert _rel_err(y, want) < BF16_TOL
    for got, ref, leaf in zip(grads, torch.autograd.grad(want, refs, g.double()), leaves):
        assert got.dtype == leaf.dtype
        assert _rel_err(got, ref) < BF16_TOL


@pytest.mark.parametrize("impl", ["segment", "grouped", "padded"])
@pytest.mark.parametrize("training", [False, True])
def test_expert_mlp_under_cuda_autocast(impl, training):
    x, idx, w1, gates = routed_inputs(24, 2, 4, 16, 32, dtype=f32)
    w2 = torch.randn(4, 32, 16, generator=torch.Generator().manual_seed(1)) / 6
    leaves = [t.requires_grad_() for t in (x, w1, w2, gates)]
    # training with dropout 0: the fused path; with dropout the composite path (two matmuls).
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=bf16):
        y = expert_mlp(x, idx, w1, w2, gates, impl=impl, training=training,
                       dropout=0.0 if not training else 1e-9)
    assert y.dtype == bf16
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(y, leaves, g.to(bf16))
    refs = [t.detach().double().requires_grad_() for t in leaves]
    want = ref_expert_mlp(refs[0], idx, refs[1], refs[2], refs[3])
    assert _rel_err(y, want) < BF16_TOL
    for got, ref, leaf in zip(grads, torch.autograd.grad(want, refs, g.double()), leaves):
        assert got.dtype == leaf.dtype
        assert _rel_err(got, ref) < BF16_TOL


def test_xl_attention_under_cuda_autocast():
    gen = torch.Generator().manual_seed(0)
    B, H, T, C = 2, 2, 6, 8
    qc, qp, k, v = (torch.randn(B, H, T, C, generator=gen, requires_grad=True) for _ in range(4))
    p = torch.randn(H, T, C, generator=gen, requires_grad=True)
    leaves = [qc, qp, k, v, p]
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=bf16):
        y = xl_attention(qc, qp, k, v, p, causal_square=True)
    assert y.dtype == bf16
    grads = torch.autograd.grad(y.float().square().sum(), leaves)
    want = xl_attention(*leaves, causal_square=True)  # float32, no autocast
    assert _rel_err(y, want) < BF16_TOL
    for got, ref in zip(grads, torch.autograd.grad(want.square().sum(), leaves)):
        assert got.dtype == f32 and _rel_err(got, ref) < 5e-2


# ---------------------------------------------------------------------------- another dtype


def _function_node(y):
    """The first node of y's graph that is a moeify Function (behind views and reshapes)."""
    todo = [y.grad_fn]
    while todo:
        node = todo.pop(0)
        if node is None:
            continue
        if hasattr(node, "saved_tensors"):  # a custom Function's node
            return node
        todo += [n for n, _ in node.next_functions]
    raise AssertionError("no custom Function in the graph")


def _bf16_cases():
    x, idx, w, gates = routed_inputs(12, 2, 4, 16, 8, dtype=bf16)
    plan = lambda: make_plan(idx, 4, group_size=4)  # noqa: E731
    for impl in ("segment", "grouped", "padded", "sets"):
        yield f"expert_matmul-{impl}", lambda impl=impl: expert_matmul(
            x.requires_grad_(), idx, w.requires_grad_(), gates.requires_grad_(), impl=impl,
            plan=plan())
    w2 = torch.randn(4, 8, 16, dtype=bf16)
    for impl in ("segment", "padded"):
        yield f"expert_mlp-{impl}", lambda impl=impl: expert_mlp(
            x.requires_grad_(), idx, w.requires_grad_(), w2.requires_grad_(),
            gates.requires_grad_(), impl=impl)
    q = torch.randn(2, 2, 6, 8, dtype=bf16)
    yield "xl_attention", lambda: xl_attention(q.requires_grad_(), q, q, q,
                                               torch.randn(2, 6, 8, dtype=bf16),
                                               causal_square=True)
    yield "dropout", lambda: dropout(x.requires_grad_(), 0.5, True)
    yield "relu_dropout", lambda: relu_dropout(x.requires_grad_(), 0.5, True)
    yield "rope", lambda: apply_rope(q.requires_grad_(), torch.arange(6), n_rot=4)


@pytest.mark.parametrize("name", [n for n, _ in _bf16_cases()])
def test_a_backward_given_a_float32_gradient_returns_the_operands_dtypes(name):
    make = dict(_bf16_cases())[name]
    torch.manual_seed(0)
    y = make()
    node = _function_node(y)
    shape = node._input_metadata[0].shape
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # as the engine runs a backward
        got = node.apply(g)  # float32 into a bf16 Function
        want = node.apply(g.to(bf16))
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert any(a is not None for a in got)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)
