"""The expert matmul (moeify.ops.moe.expert_matmul): every implementation against the
pair-by-pair definition (references.ref_expert_rows), with one input factory
(references.routed_inputs).

The matrix: implementation x output contract x gate side x routing x dtype, outputs and the x, w
and gate gradients. Then gradcheck, input without rows, edge-case routings, non-finite rows that
padding must not carry, strides, autocast, shared plans, the choice "auto" makes, and the
validation errors. The padded and expert-set layouts' own invariants are tested beside their
modules (test_padded_matmul.py, test_set_matmul.py).

Shape legend: M rows, K experts per row, E experts, D input width, F output width, G output
groups, R rows summed per output, B sequences (head-major output [B, G, S, F]).
"""

import functools
import itertools

import pytest
import torch

from moeify.ops.moe import IMPLEMENTATIONS, expert_matmul, get_kernel, make_plan, resolved_impl
from moeify.ops.moe.cpu.padded import padded_layout
from moeify.ops.moe.cpu.policy import SINGLE_THREAD_SLACK, padding_pays
from moeify.ops.moe.cpu.sets import set_layout
from references import ref_expert_matmul_grads, ref_expert_rows, routed_inputs

f64, f32, bf16 = torch.float64, torch.float32, torch.bfloat16
DTYPES = {"float64": f64, "float32": f32, "bfloat16": bf16}
pytestmark = pytest.mark.usefixtures("single_thread")

# "triton" runs on CUDA or in Triton's interpreter only (no float64): tests/ops/test_triton_matmul.py.
IMPLS = tuple(i for i in IMPLEMENTATIONS if i != "triton") + ("auto",)
# Where the gate side (D > F: gates on the outputs, D < F: on the inputs) and the balance of the
# routing choose a different computation. ("auto" runs one of the others: see the tests of what
# it chooses at the end.)
LAYOUT_IMPLS = ("padded", "sets")
# Largest error over the largest reference entry: float64 exact, bfloat16 keeps 8 bits.
TOL = {f64: 1e-12, f32: 1e-5, bf16: 2e-2}

# M rows; the ids of a row are K = G·k experts in units of k, unit u of group u % (G or R) of
# E experts each (SwitchHead's per-head experts); gated=False returns [M, K, F].
CONTRACTS = {
    "rows": dict(M=13, E=5, k=3, gated=False),  # [M, K, F]
    "sum-k1": dict(M=24, E=6, k=1),  # [M, F]: sigma-MoE, Switch
    "sum-k2": dict(M=24, E=5, k=2),
    "groups2-k2": dict(M=48, G=2, E=5, k=2),  # [M, G, F]: SwitchHead's value / key experts
    "groups3-k3": dict(M=24, G=3, E=4, k=3),
    "groups2-kE": dict(M=24, G=2, E=4, k=4),  # every expert of a group: one set per group
    "sum_rows2-k2": dict(M=48, R=2, E=5, k=2),  # [M/R, F]: SwitchHead's output / query experts
    "sum_rows3-k3": dict(M=72, R=3, E=4, k=3),
    "batch": dict(M=24, G=2, E=5, k=2, B=3),  # [B, G, S, F], as attention takes it
}
# (D, F) per dtype and gate side; grouped_mm needs row widths of multiples of 16 bytes.
SIDES = {"gates-out": {f64: (12, 5), f32: (16, 8), bf16: (16, 8)},
         "gates-in": {f64: (5, 12), f32: (8, 16), bf16: (8, 16)}}


def contract_inputs(contract, dtype, side, skew, seed=1):
    """The factory's inputs of one contract, its grouped plan and the call's keywords."""
    c = CONTRACTS[contract]
    G, R, k = c.get("G", 1), c.get("R", 1), c["k"]
    n = max(G, R)
    D, F = SIDES[side][dtype]
    x, idx, w, gates = routed_inputs(c["M"], G * k, n * c["E"], D, F, dtype=dtype, seed=seed,
                                     skew=skew, gated=c.get("gated", True), n_groups=n, unit=k)
    plan = make_plan(idx, n * c["E"], group_size=c["E"])
    return x, idx, w, gates, plan, dict(groups=G, sum_rows=R, batch=c.get("B"))


@functools.lru_cache(maxsize=None)
def contract_case(contract, dtype_name, side, skew):
    """Inputs and their reference, computed once for every implementation."""
    x, idx, w, gates, plan, kw = contract_inputs(contract, DTYPES[dtype_name], side, skew)
    return x, idx, w, gates, plan, kw, ref_expert_matmul_grads(x, idx, w, gates, **kw)


def refused(impl, x, w, call) -> bool:
    """Whether ``impl`` cannot run on these operands ("grouped": no float64, rows of 16-byte
    multiples); then ``call()`` must raise the ValueError that says why (no substitute runs)."""
    if impl == "auto" or get_kernel(impl).unavailable(x, w) is None:
        return False
    with pytest.raises(ValueError, match="needs"):
        call()
    return True


def assert_close(got, want, tol):
    assert got.shape == want.shape
    scale = want.abs().max().clamp_min(1e-12)
    assert ((got.double() - want).abs().max() / scale).item() <= tol


def check(impl, x, idx, w, gates, ref, tol, **kw):
    """expert_matmul against the reference: output, dtypes and the gradients of every input."""
    want, g, want_grads = ref
    inputs = [t.detach().requires_grad_() for t in (x, w, gates) if t is not None]

    def call():
        return expert_matmul(inputs[0], idx, inputs[1], inputs[2] if gates is not None else None,
                             impl=impl, **kw)

    if refused(impl, x, w, call):
        return None
    y = call()
    assert y.dtype == x.dtype
    assert_close(y, want, tol)
    grads = torch.autograd.grad(y, inputs, g.to(y.dtype))
    assert len(grads) == len(want_grads)
    for a, t, b in zip(grads, inputs, want_grads):
        assert a.dtype == t.dtype
        assert_close(a, b, tol)
    return y


def matrix():
    for dtype, impl, contract, side, skew in itertools.product(DTYPES, IMPLS, CONTRACTS, SIDES,
                                                               (False, True)):
        if impl == "sets" and not CONTRACTS[contract].get("gated", True):
            continue  # sets is gated only (test_sets_needs_gates_and_a_grouped_plan)
        if impl not in LAYOUT_IMPLS and (skew or side == "gates-in"):
            continue  # no layout for them to change (experts without rows: test_edge_cases)
        if skew and dtype == "float32":
            continue  # the same code as float64; bfloat16 takes other sums
        if impl == "grouped" and dtype == "float64":
            continue  # grouped_mm has no float64: it raises (test_a_named_kernel_runs_or_raises)
        yield pytest.param(dtype, impl, contract, side, skew,
                           id=f"{dtype}-{impl}-{contract}-{side}" + ("-skew" if skew else ""))


@pytest.mark.parametrize("dtype,impl,contract,side,skew", list(matrix()))
def test_matches_definition(dtype, impl, contract, side, skew):
    x, idx, w, gates, plan, kw, ref = contract_case(contract, dtype, side, skew)
    y = check(impl, x, idx, w, gates, ref, TOL[DTYPES[dtype]], plan=plan, **kw)
    if impl == "sets" and contract == "batch":  # laid out head-major, not a view
        assert y.is_contiguous()
    if impl == "grouped":  # torch's grouped GEMM ran, not a substitute
        assert resolved_impl("grouped", x, idx, w) == "grouped"


@pytest.mark.parametrize("dtype,D", [(f64, 16), (f32, 12)])
def test_a_named_kernel_runs_or_raises(dtype, D):
    # grouped_mm has no float64 and needs rows of 16-byte multiples (12 floats are 48 bytes,
    # but F = 5 floats are 20): asked for by name it raises, saying why, and runs nothing else.
    x, idx, w, gates = routed_inputs(8, 2, 4, D, 5, dtype=dtype)
    with pytest.raises(ValueError, match="grouped_mm needs float32, float16 or bfloat16 rows"):
        expert_matmul(x, idx, w, gates, impl="grouped")


@pytest.mark.parametrize("impl", ["pairs", "all", "auto"])
@pytest.mark.parametrize("contract", [c for c in CONTRACTS if CONTRACTS[c].get("gated", True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_definition_without_autograd(dtype, impl, contract):
    # Decoding runs under no_grad, where "pairs" takes its own loop (each pair one matmul adding
    # its gate-weighted product into the output row): held to the definition like the others.
    x, idx, w, gates, plan, kw, (want, _, _) = contract_case(contract, dtype, "gates-out", False)
    with torch.no_grad():
        y = expert_matmul(x, idx, w, gates, impl=impl, plan=plan, **kw)
    assert y.dtype == x.dtype
    assert_close(y, want, TOL[DTYPES[dtype]])
    with torch.no_grad():  # a handful of rows, as "auto" sees them while decoding
        few = slice(0, 2 * kw["sum_rows"] * (kw["batch"] or 1))
        kw_few = {**kw, "plan": make_plan(idx[few], w.shape[0], group_size=plan.group_size)}
        if impl == "auto" and kw_few["plan"].num_pairs <= kw_few["plan"].num_experts:
            assert resolved_impl("auto", x[few], idx[few], w, group_size=plan.group_size,
                               groups=kw["groups"]) == "pairs"
        y = expert_matmul(x[few], idx[few], w, gates[few], impl=impl, **kw_few)
    want = ref_expert_rows(x[few].double(), idx[few], w.double(), gates[few].double(),
                           kw["groups"], kw["sum_rows"])
    if kw["batch"] is not None:
        want = want.view(kw["batch"], -1, kw["groups"], want.shape[-1]).transpose(1, 2)
    assert_close(y, want, TOL[DTYPES[dtype]])


# gather's backward is autograd's; "grouped" has no float64.
@pytest.mark.parametrize("impl,side", [(i, "gates-out") for i in ("reference", "segment")]
                         + [(i, s) for i in ("padded", "sets") for s in SIDES])
def test_gradcheck(impl, side):
    D, F = (4, 3) if side == "gates-out" else (3, 4)
    x, idx, w, gates = routed_inputs(6, 4, 6, D, F, n_groups=2, unit=2)
    plan = make_plan(idx, 6, group_size=3)
    f = lambda x, w, g: expert_matmul(x, idx, w, g, groups=2, impl=impl,  # noqa: E731
                                      plan=plan)
    assert torch.autograd.gradcheck(f, (x.requires_grad_(), w.requires_grad_(),
                                        gates.requires_grad_()))


@pytest.mark.parametrize("impl,contract", [(i, c) for i in IMPLS
                                            for c in ("rows", "sum", "groups", "batch")
                                            if (i, c) != ("sets", "rows")])  # sets: gated only
def test_no_rows(impl, contract):
    G = 2 if contract in ("groups", "batch") else 1
    x, idx, w, gates = routed_inputs(0, 4, 6, 4, 3, gated=contract != "rows", n_groups=G,
                                     unit=4 // G)
    x.requires_grad_(), w.requires_grad_()

    def call():
        return expert_matmul(x, idx, w, gates, groups=G, impl=impl, batch=1 if contract ==
                             "batch" else None, plan=make_plan(idx, 6, group_size=6 // G))

    if refused(impl, x, w, call):
        return
    y = call()
    want = {"rows": (0, 4, 3), "sum": (0, 3), "groups": (0, 2, 3), "batch": (1, 2, 0, 3)}
    assert y.shape == want[contract]
    y.sum().backward()
    assert x.grad.shape == (0, 4) and (w.grad == 0).all()


EDGE_CASES = {
    "expert without rows": dict(M=10, K=1, E=4, D=8, F=8, idx=torch.tensor([[0], [2]] * 5)),
    "all rows to one expert": dict(M=10, K=1, E=4, D=8, F=8, idx=torch.full((10, 1), 3)),
    "K equals E": dict(M=7, K=4, E=4, D=8, F=8),
    "one expert": dict(M=7, K=1, E=1, D=8, F=8),
    "one row": dict(M=1, K=2, E=5, D=8, F=8),
    "D and F not multiples of 4": dict(M=11, K=2, E=3, D=7, F=5),
}


@functools.lru_cache(maxsize=None)
def edge_case(case, dtype):
    c = EDGE_CASES[case]
    x, idx, w, gates = routed_inputs(c["M"], c["K"], c["E"], c["D"], c["F"], idx=c.get("idx"),
                                     dtype=dtype)
    return x, idx, w, gates, ref_expert_matmul_grads(x, idx, w, gates)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_cases(case, impl):
    for dtype in (f64, f32):  # float32 too, where grouped_mm's alignment constraints bite
        x, idx, w, gates, ref = edge_case(case, dtype)
        plan = make_plan(idx, w.shape[0], group_size=w.shape[0]) if impl == "sets" else None
        check(impl, x, idx, w, gates, ref, TOL[dtype], plan=plan)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_inputs(impl):
    x, idx, w, gates = routed_inputs(12, 2, 4, 16, 8, dtype=f32)
    x_nc = torch.cat([x, x], 1)[:, ::2]  # stride 2 along D
    w_nc = w.transpose(1, 2).contiguous().transpose(1, 2)  # column-major expert matrices
    idx_nc = torch.cat([idx, idx], 0)[::2]
    g_nc = gates.t().contiguous().t()
    assert not x_nc.is_contiguous() and not w_nc.is_contiguous() and not idx_nc.is_contiguous()
    plan = make_plan(idx_nc, 4, group_size=4) if impl == "sets" else None
    check(impl, x_nc, idx_nc, w_nc, g_nc, ref_expert_matmul_grads(x_nc, idx_nc, w_nc, g_nc), TOL[f32],
          plan=plan)


@pytest.mark.parametrize("impl,gated", [(i, g) for i in IMPLS for g in (False, True)
                                        if (i, g) != ("sets", False)])  # sets: gated only
def test_stride_zero_gradient(impl, gated):
    # y.sum().backward() hands the backward an expanded (stride-0) gradient.
    x, idx, w, gates = routed_inputs(16, 2, 4, 16, 16, dtype=f32, gated=gated)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    plan = make_plan(idx, 4, group_size=4) if impl == "sets" else None
    expert_matmul(xr, idx, wr, gates, impl=impl, plan=plan).sum().backward()
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    ref_expert_rows(xd, idx, wd, None if gates is None else gates.double()).sum().backward()
    assert_close(xr.grad, xd.grad, TOL[f32])
    assert_close(wr.grad, wd.grad, TOL[f32])


@pytest.mark.parametrize("impl", ["padded", "sets"])
@pytest.mark.parametrize("side", list(SIDES))
def test_padding_never_leaks_a_non_finite_row(impl, side):
    # Padding slots must not carry row 0 into other rows' outputs or any other gradient.
    D, F = (6, 3) if side == "gates-out" else (3, 6)
    x, idx, w, gates = routed_inputs(30, 2, 4, D, F, seed=5, skew=True)
    plan = make_plan(idx, 4, group_size=4)
    lay = padded_layout(plan) if impl == "padded" else set_layout(idx, 4)
    assert lay.pad_P.numel() > 0
    x[0] = float("inf")
    x, w, gates = x.requires_grad_(), w.requires_grad_(), gates.requires_grad_()
    y = expert_matmul(x, idx, w, gates, impl=impl, plan=plan)
    assert torch.isfinite(y[1:]).all()
    y[1:].sum().backward()
    others = torch.ones(4, dtype=torch.bool).index_fill_(0, idx[0], False)  # not row 0's experts
    assert others.any() and torch.isfinite(w.grad[others]).all()
    assert torch.isfinite(x.grad[1:]).all() and torch.isfinite(gates.grad[1:]).all()


@pytest.mark.parametrize("side", list(SIDES))
def test_sets_on_two_grids_match_definition(side):
    # Five sets of 100 units and one of 180: two grids (100 high, then 80 for the big set's
    # overflow) instead of six blocks of 180; outputs and gradients still exact.
    sets = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]])
    ids = sets.repeat_interleave(torch.tensor([100, 100, 100, 100, 100, 180]), 0)
    g = torch.Generator().manual_seed(2)
    ids = ids[torch.randperm(ids.shape[0], generator=g)]
    ids = torch.where(torch.rand(ids.shape[0], 1, generator=g) < 0.5, ids, ids.flip(1))
    lay = set_layout(ids, 4)
    assert [(gr.n_blocks, gr.block) for gr in lay.grids] == [(6, 100), (1, 80)]
    assert lay.n_slots == ids.shape[0]  # no padding at all
    D, F = (9, 4) if side == "gates-out" else (4, 9)
    x, idx, w, gates = routed_inputs(ids.shape[0], 2, 4, D, F, idx=ids)
    check("sets", x, idx, w, gates, ref_expert_matmul_grads(x, idx, w, gates), TOL[f64],
          plan=make_plan(idx, 4, group_size=4))


@pytest.mark.parametrize("impl", ["segment", "grouped", "padded", "sets"])
def test_plan_shared_by_two_row_groupings(impl):
    # One [M, H, k] selection serves value experts ([M, H*k], groups=H) and output experts
    # ([M*H, k] rows summed over the H heads of a token), as SwitchHead with a shared selection.
    M, H, k, E = 7, 2, 2, 4
    xv, ids, wv, gates = routed_inputs(M, H * k, H * E, 6, 3, seed=5, n_groups=H, unit=k)
    plan = make_plan(ids, H * E, group_size=E)
    if refused(impl, xv, wv, lambda: expert_matmul(xv, ids, wv, gates, groups=H, impl=impl)):
        return
    v = expert_matmul(xv, ids, wv, gates, groups=H, impl=impl, plan=plan)
    assert_close(v, ref_expert_rows(xv, ids, wv, gates, groups=H), TOL[f64])
    xo, io, wo, go = routed_inputs(M * H, k, H * E, 3, 6, seed=6, idx=ids.view(M * H, k))
    go = gates.view(M * H, k)
    o = expert_matmul(xo, io, wo, go, sum_rows=H, impl=impl, plan=plan)
    assert_close(o, ref_expert_rows(xo, io, wo, go, sum_rows=H), TOL[f64])


@pytest.mark.parametrize("impl", IMPLS)
def test_autocast_runs_in_the_autocast_dtype(impl):
    x, idx, w, gates = routed_inputs(16, 2, 4, 16, 16, dtype=f32)
    with torch.autocast("cpu", dtype=bf16):
        y = expert_matmul(x, idx, w, gates, impl=impl, plan=make_plan(idx, 4, group_size=4))
    assert y.dtype == bf16
    assert_close(y, ref_expert_rows(x.double(), idx, w.double(), gates.double()), TOL[bf16])


# ---------------------------------------------------------------------------- what "auto" runs


def test_auto_pads_only_when_padding_is_small():
    _, skewed, _, _ = routed_inputs(64, 1, 8, 4, 4, skew=True)
    even = make_plan(torch.arange(64).remainder(4)[:, None], 4)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert not padding_pays(make_plan(skewed, 8))  # 8 x 64 slots for 64 pairs
        assert padding_pays(even) and 4 * 16 <= SINGLE_THREAD_SLACK * 64
        torch.set_num_threads(2)
        assert padding_pays(make_plan(skewed, 8))  # threaded: always, blocks bound the padding
        x, w = torch.zeros(64, 4), torch.zeros(8, 4, 4)
        assert resolved_impl("auto", x, skewed, w) == "padded"  # what reports name
        torch.set_num_threads(1)
        assert resolved_impl("auto", x, skewed, w) == "segment"
        assert resolved_impl("gather", x, skewed, w) == "gather"
    finally:
        torch.set_num_threads(n)


def test_auto_takes_sets_on_cpu_for_grouped_plans_only():
    M, G, E, K = 4000, 2, 5, 2
    x, ids, w, gates = routed_inputs(M, G * K, G * E, 8, 4, dtype=f32, n_groups=G, unit=K)
    grouped = make_plan(ids, G * E, group_size=E)
    plain = make_plan(ids, G * E)
    y = expert_matmul(x, ids, w, gates, groups=G, plan=grouped)
    assert grouped.holds(("set_layout", K))  # the set layout was built and used
    expert_matmul(x, ids, w, gates, groups=G, plan=plain)
    assert not plain.holds(("set_layout", K))
    want = (x.double()[:, None, None, None] @ w.double()[ids.view(M, G, K)]).squeeze(-2)  # MGKF
    torch.testing.assert_close(y.double(), (want * gates.double().view(M, G, K, 1)).sum(2),
                               rtol=1e-5, atol=1e-5)
    # What reports name (moeify bench expert-matmul): rows = units here.
    units = ids.view(M * G, K)
    xu, wu = torch.zeros(M * G, 8), torch.zeros(G * E, 8, 4)
    assert resolved_impl("auto", xu, units, wu, group_size=E) == "sets"
    assert resolved_impl("auto", xu, units, wu) != "sets"
    assert resolved_impl("auto", xu[:100], units[:100], wu, group_size=E) != "sets"


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("impl", IMPLS)
def test_invalid_input_raises_value_error(impl):
    x, idx, w, gates = routed_inputs(4, 2, 3, 8, 8)
    for bad, match in ((idx + 3, r"\[0, 3\)"), (idx - 1, r"\[0, 3\)"), (idx.double(), "integer"),
                       (idx[:3], "idx must be")):
        with pytest.raises(ValueError, match=match):
            expert_matmul(x, bad, w, impl=impl)
    calls = [
        (dict(w=w[:, :5]), "w must be"), (dict(gates=gates[:, :1]), "gates must"),
        (dict(gates=gates, groups=3), "groups"), (dict(x=x.float()), "dtype"),
        (dict(gates=gates, sum_rows=3), "sum_rows"), (dict(sum_rows=2), "sum_rows"),
        (dict(gates=gates, groups=2, sum_rows=2), "sum_rows"),
        (dict(gates=gates, batch=3), "batch"), (dict(batch=2), "batch"),
    ]
    for kw, match in calls:
        args = dict(x=x, idx=idx, w=w, gates=None) | kw
        with pytest.raises(ValueError, match=match):
            expert_matmul(args.pop("x"), args.pop("idx"), args.pop("w"), args.pop("gates"),
                          impl=impl, **args)


def test_unknown_implementation_and_plan_mismatch():
    x, idx, w, _ = routed_inputs(4, 2, 3, 8, 8)
    with pytest.raises(ValueError, match="unknown expert-matmul implementation"):
        expert_matmul(x, idx, w, impl="fastest")
    with pytest.raises(ValueError, match="plan was built"):
        expert_matmul(x, idx, w, impl="segment", plan=make_plan(idx[:2], 3))


def test_sets_needs_gates_and_a_grouped_plan():
    x, ids, w, gates = routed_inputs(20, 2, 4, 3, 3)
    with pytest.raises(ValueError, match="group_size"):
        expert_matmul(x, ids, w, gates, impl="sets", plan=make_plan(ids, 4))
    with pytest.raises(ValueError, match="gates"):
        expert_matmul(x, ids, w, None, impl="sets", plan=make_plan(ids, 4, group_size=4))
    with pytest.raises(ValueError, match="group_size"):
        make_plan(ids, 4, group_size=3)


def test_decoding_sums_over_every_expert_match_the_definition():
    # SwitchHead's decoding layouts (ops/moe/cpu/decoding.py): products of every expert already
    # computed (the fused projection), or one GEMM over every expert with the heads summed.
    from moeify.ops.moe.cpu.decoding import gated_group_sum_all, gated_sum_of_all
    g = torch.Generator().manual_seed(0)
    T, G, E, K, C, F = 5, 3, 4, 2, 6, 7
    idx_TGK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T * G)]).view(T, G, K)
    gates_TGK = torch.rand(T, G, K, generator=g, dtype=torch.float64)
    x_TGC = torch.randn(T, G, C, generator=g, dtype=torch.float64)
    w_XCF = torch.randn(G * E, C, F, generator=g, dtype=torch.float64)
    ids = (idx_TGK + torch.arange(G)[:, None] * E).view(T * G, K)
    want = ref_expert_rows(x_TGC.view(T * G, C), ids, w_XCF, gates_TGK.view(T * G, K),
                           sum_rows=G)
    torch.testing.assert_close(gated_group_sum_all(x_TGC, idx_TGK, gates_TGK, w_XCF), want,
                               rtol=1e-12, atol=1e-12)
    x_TD = torch.randn(T, C, generator=g, dtype=torch.float64)  # V: one input row, G heads
    y_TGEF = torch.einsum("td,gedf->tgef", x_TD, w_XCF.view(G, E, C, F))
    want = ref_expert_rows(x_TD, ids.view(T, G * K), w_XCF, gates_TGK.view(T, G * K), groups=G)
    torch.testing.assert_close(gated_sum_of_all(y_TGEF, idx_TGK, gates_TGK), want,
                               rtol=1e-12, atol=1e-12)


def test_triton_is_optional(monkeypatch):
    """Without triton installed, moeify runs as before ("auto" never takes "triton") and asking
    for it by name says which extra to install (its kernels: tests/ops/test_triton_matmul.py)."""
    from moeify.ops.moe.kernels import scatter_gemm as triton_matmul

    monkeypatch.setattr(triton_matmul, "triton_available", lambda: False)
    x, idx, w, gates = routed_inputs(8, 2, 4, 16, 8, dtype=f32)
    assert resolved_impl("auto", x, idx, w) != "triton"
    with pytest.raises(ValueError, match=r"pip install -e '\.\[triton\]'"):
        expert_matmul(x, idx, w, gates, impl="triton")
