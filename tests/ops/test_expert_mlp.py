"""The fused expert MLP (moeify.ops.moe.mlp) against the pair-by-pair definition
(tests/references.py), outputs and every gradient, in float64, for each layout it runs in."""

import pytest
import torch

from moeify.bench.timing import expert_impls_run
from moeify.layers.sigma_moe import SigmaMoEConfig
from moeify.layers.switch_ff import SwitchFFConfig
from moeify.ops.moe import choose_impl, make_plan
from moeify.ops.moe.cpu.policy import ALL_MAX_ROWS
from moeify.ops.moe import expert_mlp
from moeify.ops.moe.cpu.padded import padded_layout
from references import ref_expert_mlp

f64 = torch.float64


def routed(M, K, E, D, G, *, skew=False, seed=0, dtype=f64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g, dtype=dtype).requires_grad_()
    w1 = torch.randn(E, D, G, generator=g, dtype=dtype).requires_grad_()
    w2 = torch.randn(E, G, D, generator=g, dtype=dtype).requires_grad_()
    scores = torch.rand(M, E, generator=g)
    if skew:  # expert 0 takes most rows: the blocked padded layout
        scores[:, 0] += 2 * (torch.rand(M, generator=g) < 0.8)
    idx = scores.topk(K, -1).indices
    gates = torch.rand(M, K, generator=g).requires_grad_()
    return x, idx, w1, w2, gates


def grads(y, inputs, g):
    return torch.autograd.grad(y, inputs, g)


@pytest.mark.parametrize("impl", ["segment", "grouped", "padded", "auto", "reference", "gather",
                                  "pairs", "all"])
@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("K", [1, 2])
def test_matches_definition_with_every_gradient(impl, skew, K):
    x, idx, w1, w2, gates = routed(40, K, 4, 6, 5, skew=skew)
    plan = make_plan(idx, 4)
    if impl == "grouped":  # grouped_mm has no float64: named, it raises (no substitute runs)
        with pytest.raises(ValueError, match="grouped_mm needs float32"):
            expert_mlp(x, idx, w1, w2, gates, impl=impl, plan=plan)
        return
    y = expert_mlp(x, idx, w1, w2, gates, impl=impl, plan=plan)
    ref = ref_expert_mlp(x, idx, w1, w2, gates)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(ref)
    inputs = (x, w1, w2, gates)
    for a, b in zip(grads(y, inputs, g), grads(ref, inputs, g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    if impl == "padded":  # both padded layouts are exercised
        assert (padded_layout(plan).block_expert is not None) == skew


def test_float32_grouped_matches_definition():
    x, idx, w1, w2, gates = routed(64, 2, 4, 16, 8, dtype=torch.float32)
    y = expert_mlp(x, idx, w1, w2, gates, impl="grouped")
    ref = ref_expert_mlp(x, idx, w1, w2, gates)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(ref)
    for a, b in zip(grads(y, (x, w1, w2, gates), g), grads(ref, (x, w1, w2, gates), g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_broadcast_gradient_and_empty_batch():
    x, idx, w1, w2, gates = routed(9, 2, 3, 4, 4)
    expert_mlp(x, idx, w1, w2, gates, impl="padded").sum().backward()  # stride-0 gradient
    ref_x = x.grad.clone()
    x.grad = None
    ref_expert_mlp(x, idx, w1, w2, gates).sum().backward()
    torch.testing.assert_close(ref_x, x.grad)
    y = expert_mlp(x[:0], idx[:0], w1, w2, gates[:0])
    assert y.shape == (0, 4)


def test_dropout_takes_the_composite_path_only_in_training():
    x, idx, w1, w2, gates = routed(30, 2, 3, 4, 6)
    ref = ref_expert_mlp(x, idx, w1, w2, gates)
    torch.testing.assert_close(expert_mlp(x, idx, w1, w2, gates, dropout=0.5), ref)
    torch.manual_seed(0)
    y = expert_mlp(x, idx, w1, w2, gates, dropout=0.5, training=True)
    assert not torch.allclose(y, ref)


def test_validation():
    x, idx, w1, w2, gates = routed(6, 2, 3, 4, 5)
    with pytest.raises(ValueError, match="w2 must be"):
        expert_mlp(x, idx, w1, w1, gates)
    with pytest.raises(ValueError, match="gates"):
        expert_mlp(x, idx, w1, w2, gates[:, :1])
    with pytest.raises(ValueError, match="plan was built"):
        expert_mlp(x, idx, w1, w2, gates, impl="segment", plan=make_plan(idx[:3], 3))


@pytest.mark.parametrize("threads", [1, 2])
def test_layers_run_what_choose_impl_decides(threads):
    # One decision for every layer: the feedforwards run the implementation choose_impl names.
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        x = torch.randn(2, 64, 16)
        for cfg in (SigmaMoEConfig(d_model=16, n_experts=4, expert_size=8, k=2),
                    SwitchFFConfig(d_model=16, d_ff=8, n_experts=4, k=2, dropless=True)):
            layer = cfg.build()
            ran = expert_impls_run(lambda: layer(x))
            _, gates, idx = (layer.route(x.view(-1, 16)) if hasattr(layer, "route")
                             else (None, None, None))
            if idx is None:  # Switch: the same top-k the layer takes
                idx = torch.softmax(x.view(-1, 16) @ layer.w_router.T, -1).topk(2, -1).indices
            w = next(p for p in layer.parameters() if p.dim() == 3)
            want = choose_impl("auto", x.view(-1, 16), w, make_plan(idx, 4), k=2)
            assert ran == [want]
            # The rule, computed here: padded with several threads; single-threaded only when
            # 4 blocks of the largest expert's count pad the 256 pairs by at most 10%.
            counts = torch.bincount(idx.reshape(-1), minlength=4)
            nearly_free = 4 * int(counts.max()) <= 1.1 * idx.numel()
            assert want == ("padded" if threads > 1 or nearly_free else "segment")
    finally:
        torch.set_num_threads(n)


def test_auto_takes_the_decoding_layouts_for_a_handful_of_rows_only():
    # Decoding routes a handful of rows: "auto" multiplies by views of the routed matrices (a
    # few pairs) or by every expert (a few rows): no sort, no copied weights.
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w = torch.zeros(10, 4, 3)
        few = torch.tensor([[1, 2], [3, 9]])  # 4 pairs <= 10 experts
        assert choose_impl("auto", torch.zeros(2, 4), w, make_plan(few, 10)) == "pairs"
        some = torch.arange(24).remainder(10).view(12, 2)  # 24 pairs, 12 rows
        assert choose_impl("auto", torch.zeros(12, 4), w, make_plan(some, 10)) == "all"
        rows = ALL_MAX_ROWS + 8
        many = torch.arange(2 * rows).remainder(10).view(rows, 2)
        assert choose_impl("auto", torch.zeros(rows, 4), w, make_plan(many, 10)) == "padded"
        assert choose_impl("segment", torch.zeros(2, 4), w, make_plan(few, 10)) == "segment"
        # A few rows but huge experts: the E/K extra multiply-adds are not worth it.
        big = torch.zeros(10, 2048, 4096)
        assert choose_impl("auto", torch.zeros(12, 2048), big, make_plan(some, 10)) != "all"
    finally:
        torch.set_num_threads(n)


def test_hidden_biases_match_the_definition():
    x, idx, w1, w2, gates = routed(20, 2, 3, 4, 5)
    b1 = torch.randn(3, 5, dtype=f64, requires_grad=True)
    y = expert_mlp(x, idx, w1, w2, gates, bias_EG=b1)
    M, K = idx.shape
    ref = torch.stack([sum(gates[m, k].to(f64) * (torch.relu(x[m] @ w1[idx[m, k]] + b1[idx[m, k]])
                                                  @ w2[idx[m, k]]) for k in range(K))
                       for m in range(M)])
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(ref)
    for a, b in zip(grads(y, (x, w1, w2, gates, b1), g), grads(ref, (x, w1, w2, gates, b1), g)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("impl", ["segment", "padded", "auto", "reference"])
def test_another_activation_matches_the_definition(impl):
    import torch.nn.functional as F

    x, idx, w1, w2, gates = routed(20, 2, 3, 4, 5)
    y = expert_mlp(x, idx, w1, w2, gates, impl=impl,
                   activation=lambda h: F.gelu(h, approximate="tanh"))
    ref = ref_expert_mlp(x, idx, w1, w2, gates, "gelu_tanh")
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(ref)
    for a, b in zip(grads(y, (x, w1, w2, gates), g), grads(ref, (x, w1, w2, gates), g)):
        torch.testing.assert_close(a, b)
