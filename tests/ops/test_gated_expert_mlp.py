"""The gated (SwiGLU) expert MLP against a naive loop over (token, choice) pairs, forward and every
gradient, in float64, for each expert-matmul implementation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeify.ops.moe import gated_expert_mlp


def _naive(x, idx, wg, wu, wd, gates):
    y = torch.zeros_like(x)
    rows = []
    for m in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for k in range(idx.shape[1]):
            e = idx[m, k]
            acc = acc + gates[m, k] * ((F.silu(x[m] @ wg[e]) * (x[m] @ wu[e])) @ wd[e])
        rows.append(acc)
    return y + torch.stack(rows)


@pytest.mark.parametrize("impl", ["reference", "gather", "segment", "padded", "auto"])
def test_gated_expert_mlp_matches_a_loop_with_gradients(impl):
    g = torch.Generator().manual_seed(0)
    M, K, E, D, G = 7, 2, 4, 5, 3
    x = torch.randn(M, D, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)])
    ws = [torch.randn(E, D, G, generator=g, dtype=torch.float64, requires_grad=True)
          for _ in range(2)]
    wd = torch.randn(E, G, D, generator=g, dtype=torch.float64, requires_grad=True)
    gates = torch.rand(M, K, generator=g, dtype=torch.float64, requires_grad=True)
    inputs = [x, *ws, wd, gates]
    got = gated_expert_mlp(x, idx, ws[0], ws[1], wd, gates, impl=impl)
    want = _naive(x, idx, ws[0], ws[1], wd, gates)
    assert torch.allclose(got, want, atol=1e-12)
    dy = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, inputs, dy), torch.autograd.grad(want, inputs, dy)):
        assert torch.allclose(a, b, atol=1e-12)


def test_gated_expert_mlp_checks_shapes():
    x, idx = torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long)
    w = torch.zeros(3, 4, 5)
    with pytest.raises(ValueError, match="w_down must be"):
        gated_expert_mlp(x, idx, w, w, torch.zeros(3, 4, 5), torch.ones(2, 1))
