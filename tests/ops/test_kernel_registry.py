"""The kernel seam (moeify.ops.moe.registry): a kernel added from outside the package, as one
class registered by name, runs every output contract of the expert matmul, its gradients, the
fused expert MLP, a layer's config and the registered op of torch.compile; and what the
registry refuses.

Shape legend: M rows, K experts per row, E experts, D input width, F output width."""

from dataclasses import replace

import pytest
import torch

from moeify.layers.sigma_moe import SigmaMoEConfig
from moeify.ops.moe import (
    ExpertKernel,
    expert_matmul,
    expert_mlp,
    get_kernel,
    implementations,
    register,
)
from moeify.ops.moe.layout import pair_layout
from moeify.ops.moe.registry import KERNELS
from references import assert_kernel_matches_reference, ref_expert_rows, routed_inputs

f64 = torch.float64


class LoopKernel(ExpertKernel):
    """The obvious kernel: one matmul per slot (what a kernel author starts from)."""

    name = "test-loop"

    def forward(self, a, w_EAB, lay, k=None):
        a_PA = self.slot_rows(a, lay, k)
        e_P = lay.plan.flat_N.index_select(0, lay.pair_P)
        return torch.stack([a_PA[p] @ w_EAB[e] for p, e in enumerate(e_P.tolist())]) \
            if len(e_P) else a_PA.new_zeros(0, w_EAB.shape[-1])

    def weight_grad(self, a, g_PB, lay, n_experts, k=None):
        a_PA = self.slot_rows(a, lay, k)
        out = a_PA.new_zeros(n_experts, a_PA.shape[1], g_PB.shape[1])
        for p, e in enumerate(lay.plan.flat_N.index_select(0, lay.pair_P).tolist()):
            out[e] += torch.outer(a_PA[p], g_PB[p])
        return out


@pytest.fixture
def loop_kernel():
    kernel = register(LoopKernel())
    yield kernel
    del KERNELS[kernel.name]


CONTRACTS = {"rows": (1, 1, False), "sum": (1, 1, True), "groups": (2, 1, True),
             "sum_rows": (1, 2, True)}


@pytest.mark.parametrize("contract", CONTRACTS)
def test_a_registered_kernel_runs_every_contract(loop_kernel, contract):
    groups, sum_rows, gated = CONTRACTS[contract]
    assert_kernel_matches_reference("test-loop", 12, 4, 5, 6, 3, groups=groups,
                                    sum_rows=sum_rows, gated=gated)


def test_a_registered_kernel_runs_the_expert_mlp_and_a_layer(loop_kernel):
    x, idx, w1, gates = routed_inputs(10, 2, 4, 6, 5)
    w2 = torch.randn(4, 5, 6, dtype=f64)
    args = (x.requires_grad_(), idx, w1.requires_grad_(), w2.requires_grad_(),
            gates.requires_grad_())
    y = expert_mlp(*args, impl="test-loop")
    h = torch.relu(ref_expert_rows(x, idx, w1, None))  # [M, K, G]
    want = ref_expert_rows(h.reshape(-1, 5), idx.reshape(-1, 1), w2, gates.reshape(-1, 1),
                           sum_rows=2)
    torch.testing.assert_close(y, want)
    got = torch.autograd.grad(y.sum(), args[2:])
    ref = torch.autograd.grad(want.sum(), args[2:])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    assert "test-loop" in implementations()
    cfg = SigmaMoEConfig(d_model=6, n_experts=4, expert_size=4, k=2, expert_impl="test-loop")
    layer, ref_layer = cfg.build().double(), replace(cfg, expert_impl="reference").build().double()
    ref_layer.load_state_dict(layer.state_dict())
    xl = torch.randn(2, 3, 6, dtype=f64)
    xs = [xl.clone().requires_grad_() for _ in range(2)]
    out, want = layer(xs[0])[0], ref_layer(xs[1])[0]
    torch.testing.assert_close(out, want)  # the layer's values, not only its shape
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [xs[0], *layer.parameters()], g)
    ref = torch.autograd.grad(want, [xs[1], *ref_layer.parameters()], g)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_a_registered_kernel_runs_inside_the_compiled_op(loop_kernel):
    from moeify.ops.moe.compiled import expert_matmul_op

    x, idx, w, gates = routed_inputs(8, 2, 4, 6, 3)
    want = ref_expert_rows(x, idx, w, gates)
    y = expert_matmul_op(x, idx, w, gates, 1, 1, None, "test-loop")
    torch.testing.assert_close(y, want)


class PairOrderKernel(LoopKernel):
    """The loop over the pairs in their own order (slot p = pair p), handed gathered rows."""

    name = "test-pair-order"

    def layout(self, plan):
        return pair_layout(plan)


def test_a_pair_order_kernel_leaves_the_output_gradient_alone():
    """Gated with one expert per row and D > F, the backward scales the slots' output gradient
    by the gates: never the caller's gradient tensor in place."""
    kernel = register(PairOrderKernel())
    try:
        x, idx, w, gates = routed_inputs(6, 1, 3, 8, 4)
        inputs = [t.clone().requires_grad_() for t in (x, w, gates)]
        y = expert_matmul(*inputs[:1], idx, *inputs[1:], impl="test-pair-order")
        gy = torch.ones_like(y)
        got = torch.autograd.grad(y, inputs, gy)
        assert torch.equal(gy, torch.ones_like(y))
        xr, wr, gr = (t.clone().requires_grad_() for t in (x, w, gates))
        want = ref_expert_rows(xr, idx, wr, gr)
        torch.testing.assert_close(y, want)
        ref = torch.autograd.grad(want, (xr, wr, gr), torch.ones_like(y))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b)
    finally:
        del KERNELS[kernel.name]


def test_the_registry_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="unknown expert-matmul implementation 'nope'"):
        get_kernel("nope")

    class Nameless(ExpertKernel):
        pass

    with pytest.raises(ValueError, match="needs a name"):
        register(Nameless())
    with pytest.raises(ValueError, match="expert_impl must be one of"):
        SigmaMoEConfig(d_model=6, n_experts=4, expert_size=4, k=2, expert_impl="not-registered")
