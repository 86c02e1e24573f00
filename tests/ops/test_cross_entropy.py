"""The fused output layer + cross-entropy against the reference (materialised logits): loss and
every gradient, float64 and float32, with and without bias and padding, chunked or not."""

import pytest
import torch

from moeify.ops.cross_entropy import linear_cross_entropy, reference_linear_cross_entropy


def _inputs(dtype, bias, valid, N=37, D=11, V=53, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, D, generator=g, dtype=dtype) * 0.7).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) if bias else None)
    if b is not None:
        b.requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    m = (torch.rand(N, generator=g) > 0.3) if valid else None
    return h, w, b, t, m


def _loss_and_grads(fn, h, w, b, t, m, **kw):
    leaves = [x for x in (h, w, b) if x is not None]
    loss = fn(h, w, b, t, m, **kw)
    return loss.detach(), torch.autograd.grad(loss * 1.7, leaves)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("valid", [False, True])
@pytest.mark.parametrize("chunk_rows", [None, 1, 8, 36])
def test_fused_equals_reference_loss_and_gradients(dtype, tol, bias, valid, chunk_rows):
    args = _inputs(dtype, bias, valid)
    ref_loss, ref_grads = _loss_and_grads(reference_linear_cross_entropy, *args)
    loss, grads = _loss_and_grads(linear_cross_entropy, *args, impl="fused",
                                  chunk_rows=chunk_rows)
    assert loss.dtype == ref_loss.dtype
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=tol, atol=tol)
    assert ref_grads[0].abs().max() > 1e-3  # a non-trivial gradient is being compared


def test_auto_takes_the_fused_path_only_with_gradients_and_keeps_no_logits():
    h, w, b, t, _ = _inputs(torch.float32, True, False, N=64, V=500)
    seen = []

    def pack(x):
        seen.append(x.shape)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = linear_cross_entropy(h, w, b, t)
    assert loss.grad_fn is not None and "FusedLinearCE" in type(loss.grad_fn).__name__
    assert all(500 not in s for s in seen)  # nothing V wide kept for backward
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, b, t),
                                   reference_linear_cross_entropy(h, w, b, t))


def test_all_padding_gives_zero_loss_and_gradients():
    h, w, b, t, _ = _inputs(torch.float64, True, False)
    m = torch.zeros(len(t), dtype=torch.bool)
    loss, grads = _loss_and_grads(linear_cross_entropy, h, w, b, t, m, impl="fused")
    assert loss == 0 and all(torch.count_nonzero(g) == 0 for g in grads)


def test_frozen_output_layer_gets_no_gradient():
    h, w, b, t, _ = _inputs(torch.float32, True, False)
    w.requires_grad_(False)
    b.requires_grad_(False)
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, w, b, t, impl="fused"), [h])
    (rh,) = torch.autograd.grad(reference_linear_cross_entropy(h, w, b, t), [h])
    torch.testing.assert_close(gh, rh)


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="impl"):
        linear_cross_entropy(*_inputs(torch.float32, True, False), impl="chunked")
