"""The dense-over-experts kernels "concat" and "concat_saved" (moeify.ops.moe.kernels.concat)
against the float64 pair-by-pair references: every output contract in both of their forms,
every gradient, the expert MLP; what their backwards keep ("concat": x, w and the gate matrix,
never the [M, E·F] intermediate; "concat_saved": that intermediate too, and one product fewer
in the backward); torch.compile (fullgraph) traces them in place of the registered op and
equals eager; a routing with a different number of experts per row is a gate matrix.

Shape legend: M rows, K experts per row, E experts, D input width, F output width, G groups,
R rows summed per output, H hidden width."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moeify.ops.moe import expert_matmul, expert_mlp, get_kernel
from moeify.ops.moe.kernels.concat import ConcatMatmul, outer_form
from references import (
    assert_kernel_matches_reference,
    ref_expert_mlp,
    ref_expert_rows,
    routed_inputs,
)

f64 = torch.float64
# The kernel, and its variant that keeps the intermediate for the backward.
KERNELS = ("concat", "concat_saved")

# (groups, sum_rows, gated, D, F): each gated contract once with D > F and once with D < F,
# so both the V form (gates on the output) and the O form (gates on the input) run.
CASES = {
    "rows": (1, 1, False, 6, 5),
    "sum-V": (1, 1, True, 7, 5),
    "sum-O": (1, 1, True, 5, 7),
    "groups-V": (2, 1, True, 7, 5),
    "groups-O": (2, 1, True, 5, 7),
    "sum_rows-V": (1, 3, True, 7, 5),
    "sum_rows-O": (1, 3, True, 5, 7),
}


def _grads(y, inputs, gy):
    return torch.autograd.grad(y, inputs, gy)


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("case", CASES)
def test_every_contract_and_gradient_matches_the_reference(case, impl):
    groups, sum_rows, gated, D, F = CASES[case]
    assert_kernel_matches_reference(impl, 12, 4, 5, D, F, groups=groups, sum_rows=sum_rows,
                                    gated=gated, seed=3)


def test_the_form_follows_the_rows_of_the_gemm():
    # SwitchHead's V (groups = heads, D > F): V; its O (sum_rows = heads): O; a tie: the
    # narrower intermediate; no gates: V (one output per pair).
    assert not outer_form(True, 2, 1, 412, 76)
    assert outer_form(True, 1, 2, 76, 412)
    assert outer_form(True, 1, 1, 5, 7) and not outer_form(True, 1, 1, 7, 5)
    assert not outer_form(False, 1, 1, 5, 7)


def test_repeated_ids_in_a_row_add():
    x, _, w, gates = routed_inputs(6, 3, 4, 5, 3, seed=1)
    idx = torch.tensor([[0, 0, 2], [1, 3, 1], [2, 2, 2], [3, 0, 1], [0, 1, 0], [2, 3, 3]])
    inputs = [t.clone().requires_grad_() for t in (x, w, gates)]
    y = expert_matmul(*inputs[:1], idx, inputs[1], inputs[2], impl="concat")
    want = ref_expert_rows(x, idx, w, gates)
    torch.testing.assert_close(y, want)
    gy = torch.randn_like(y)
    ref_in = [t.clone().requires_grad_() for t in (x, w, gates)]
    ref = ref_expert_rows(ref_in[0], idx, ref_in[1], ref_in[2])
    for got, r in zip(_grads(y, inputs, gy), _grads(ref, ref_in, gy)):
        torch.testing.assert_close(got, r)


@pytest.mark.parametrize("impl", KERNELS)
def test_the_expert_mlp_and_its_gradients(impl):
    x, idx, w1, gates = routed_inputs(10, 2, 4, 6, 5, seed=2)
    w2 = torch.randn(4, 5, 6, dtype=f64, generator=torch.Generator().manual_seed(4))
    inputs = [t.clone().requires_grad_() for t in (x, w1, w2, gates)]
    y = expert_mlp(inputs[0], idx, inputs[1], inputs[2], inputs[3], impl=impl)
    ref_in = [t.clone().requires_grad_() for t in (x, w1, w2, gates)]
    want = ref_expert_mlp(ref_in[0], idx, ref_in[1], ref_in[2], ref_in[3])
    torch.testing.assert_close(y, want)
    gy = torch.randn_like(y)
    for got, r in zip(_grads(y, inputs, gy), _grads(want, ref_in, gy)):
        torch.testing.assert_close(got, r)


def _saved_numels(fn):
    """The element counts of every tensor autograd saves while ``fn()`` runs."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


@pytest.mark.parametrize("what", ["V", "O", "mlp"])
def test_the_backward_keeps_no_intermediate_over_all_experts(what):
    # Only x, w and the gate matrix (and dense_gates' ids) are saved: nothing as large as the
    # [M, E·F] products of every expert, nor the [T, E·D] gated inputs.
    M, K, E, D, F = 64, 2, 8, 12, 10
    x, idx, w, gates = routed_inputs(M, K, E, D, F, seed=5)
    x.requires_grad_(), w.requires_grad_(), gates.requires_grad_()
    if what == "mlp":
        w2 = torch.randn(E, F, D, dtype=f64, requires_grad=True)
        sizes = _saved_numels(lambda: expert_mlp(x, idx, w, w2, gates, impl="concat"))
        allowed = {M * D, E * D * F, M * E, M * K}
    elif what == "V":
        sizes = _saved_numels(lambda: expert_matmul(x, idx, w, gates, groups=2, impl="concat"))
        allowed = {M * D, E * D * F, M * 2 * E, M * K}
    else:
        wo = w.transpose(1, 2).contiguous().requires_grad_()
        sizes = _saved_numels(lambda: expert_matmul(x[:, :F].contiguous(), idx, wo, gates,
                                                    sum_rows=2, impl="concat"))
        allowed = {M * F, E * D * F, M * E, M * K}
    assert sizes and set(sizes) <= allowed, sizes
    assert max(sizes) < M * E * min(D, F)


def _saved_run(what, impl, M=64, K=2, E=8, D=12, F=10):
    """(numels saved, backward MACs) of one call of ``impl``: the V form (SwitchHead's value
    experts, 2 heads), the O form (its output experts) or the expert MLP."""
    x, idx, w, gates = routed_inputs(M, K, E, D, F, seed=5)
    x.requires_grad_(), w.requires_grad_(), gates.requires_grad_()
    if what == "mlp":
        w2 = torch.randn(E, F, D, dtype=f64, requires_grad=True)
        call = lambda: expert_mlp(x, idx, w, w2, gates, impl=impl)  # noqa: E731
    elif what == "V":
        call = lambda: expert_matmul(x, idx, w, gates, groups=2, impl=impl)  # noqa: E731
    else:
        wo = w.transpose(1, 2).contiguous().requires_grad_()
        xo = x[:, :F].contiguous()
        call = lambda: expert_matmul(xo, idx, wo, gates, sum_rows=2, impl=impl)  # noqa: E731
    out = []
    sizes = _saved_numels(lambda: out.append(call()))
    flops = FlopCounterMode(display=False)
    with flops:
        out[0].sum().backward()
    return sizes, flops.get_total_flops() // 2


@pytest.mark.parametrize("what", ["V", "O", "mlp"])
def test_concat_saved_keeps_the_intermediate_and_skips_its_recomputation(what):
    # "concat_saved" saves exactly one tensor more than "concat", the intermediate over every
    # expert: Y [M, E·F] (V), the gated inputs Z [M / 2, E·F] (O, two rows summed per output),
    # the hidden units [M, E·F] (MLP); its backward skips the product that rebuilt it (Y and
    # the hidden units: x @ W_cat, M·D·E·F multiply-adds; Z: the [2, E]ᵀ x [2, F] bmm per
    # output row, (M / 2)·E·2·F).
    M, E, D, F = 64, 8, 12, 10
    sizes, macs = _saved_run(what, "concat", M, 2, E, D, F)
    sizes_saved, macs_saved = _saved_run(what, "concat_saved", M, 2, E, D, F)
    kept = {"V": M * E * F, "O": M // 2 * E * F, "mlp": M * E * F}[what]
    assert sorted(sizes_saved) == sorted(sizes + [kept])
    skipped = {"V": M * D * E * F, "O": M // 2 * E * 2 * F, "mlp": M * D * E * F}[what]
    assert macs - macs_saved == skipped


@pytest.mark.parametrize("case,impl", [("rows", "concat"), ("groups-V", "concat"),
                                       ("sum_rows-O", "concat"), ("groups-V", "concat_saved"),
                                       ("sum_rows-O", "concat_saved")])
def test_compiled_fullgraph_traces_it_in_place_and_equals_eager(case, impl):
    groups, sum_rows, gated, D, F = CASES[case]
    x, idx, w, gates = routed_inputs(12, 4, 5, D, F, gated=gated, dtype=torch.float32, seed=6)
    calls = []

    def backend(gm, example_inputs):
        calls.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    f = torch.compile(lambda *a: expert_matmul(*a, groups=groups, sum_rows=sum_rows,
                                               impl=impl), fullgraph=True, backend=backend)
    inputs = [t.clone().requires_grad_() for t in (x, w, gates) if t is not None]
    eager_in = [t.clone().requires_grad_() for t in inputs]
    g = None if not gated else inputs[2]
    y = f(inputs[0], idx, inputs[1], g)
    want = expert_matmul(eager_in[0], idx, eager_in[1], eager_in[2] if gated else None,
                         groups=groups, sum_rows=sum_rows, impl=impl)
    torch.testing.assert_close(y, want)
    gy = torch.randn_like(y)
    for a, b in zip(_grads(y, inputs, gy), _grads(want, eager_in, gy)):
        torch.testing.assert_close(a, b)
    # Traced in place: no registered expert op, no host read-back in the graph.
    assert torch.ops.moeify.expert_matmul.default not in calls
    assert calls


@pytest.mark.parametrize("impl", KERNELS)
def test_the_compiled_expert_mlp_is_the_kernels_own(impl):
    x, idx, w1, gates = routed_inputs(10, 2, 4, 6, 5, dtype=torch.float32, seed=7)
    w2 = torch.randn(4, 5, 6)
    torch._dynamo.reset()
    f = torch.compile(lambda *a: expert_mlp(*a, impl=impl), fullgraph=True, backend="eager")
    inputs = [t.clone().requires_grad_() for t in (x, w1, w2, gates)]
    eager_in = [t.detach().clone().requires_grad_() for t in inputs]
    y = f(inputs[0], idx, *inputs[1:])
    want = expert_mlp(eager_in[0], idx, *eager_in[1:], impl=impl)
    torch.testing.assert_close(y, want)
    y.sum().backward()
    want.sum().backward()
    for a, b in zip(inputs, eager_in):
        torch.testing.assert_close(a.grad, b.grad)


def test_a_variable_number_of_experts_per_row_is_a_gate_matrix():
    # Row m selects the first k_m of its ids (k_m = 1..3): the gate matrix of the selected
    # pairs, through the core Function, equals the reference over each row's own pairs.
    x, idx, w, gates = routed_inputs(6, 3, 5, 7, 4, seed=8)
    k_M = torch.tensor([1, 2, 3, 1, 3, 2])
    keep_MK = torch.arange(3)[None, :] < k_M[:, None]
    gate_ME = torch.zeros(6, 5, dtype=f64).scatter_add_(1, idx, gates * keep_MK)
    y = ConcatMatmul.apply(x, w, gate_ME.view(6, 1, 5), 1, False).view(6, 4)
    want = torch.stack([sum(gates[m, j] * x[m] @ w[idx[m, j]] for j in range(int(k_M[m])))
                        for m in range(6)])
    torch.testing.assert_close(y, want)


@pytest.mark.parametrize("impl", KERNELS)
def test_it_needs_no_routing_plan(impl):
    kernel = get_kernel(impl)
    assert not kernel.needs_plan and kernel.traceable


def test_the_variant_is_measured_but_not_in_the_test_matrices():
    from moeify.ops.moe import IMPLEMENTATIONS, implementations

    assert get_kernel("concat_saved").variant_of == "concat"
    assert "concat_saved" in implementations() and "concat_saved" not in IMPLEMENTATIONS
    assert set(implementations()) - set(IMPLEMENTATIONS) == {"concat_saved"}
