"""moeify.ops.dropout against torch's own dropout: same masks, outputs and gradients (bit for
bit, float32 and float64), and less kept for backward."""

import pytest
import torch
import torch.nn.functional as F

from moeify.ops.dropout import dropout, relu_dropout


def _saved_bytes(fn, x):
    """Bytes of the distinct non-input tensors autograd keeps for backward of ``fn(x)``."""
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    return y, sum(seen.values())


def _run(fn, x0, g, seed):
    x = x0.clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = fn(x)
    y.backward(g)
    return y.detach(), x.grad


CASES = [
    ("dropout", lambda x, impl: dropout(x, 0.3, True, impl=impl),
     lambda x: F.dropout(x, 0.3, True)),
    ("relu_dropout", lambda x, impl: relu_dropout(x, 0.3, True, impl=impl),
     lambda x: F.dropout(F.relu(x), 0.3, True)),
]


@pytest.mark.parametrize("name,fast,ref", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_equals_torch_outputs_and_gradients(name, fast, ref, dtype):
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(6, 33, 17, generator=gen, dtype=dtype)
    g = torch.randn(6, 33, 17, generator=gen, dtype=dtype)
    for seed in (1, 2):
        y_ref, gx_ref = _run(ref, x0, g, seed)
        for impl in ("fast", "auto", "reference"):
            y, gx = _run(lambda x: fast(x, impl), x0, g, seed)
            assert torch.equal(y, y_ref), (name, impl)
            assert torch.equal(gx, gx_ref), (name, impl)
    # the masks really drop something and really differ between seeds
    assert (y_ref == 0).float().mean() > 0.2
    assert not torch.equal(_run(ref, x0, g, 1)[0], _run(ref, x0, g, 2)[0])


def test_random_stream_after_the_call_is_torchs():
    x = torch.randn(100)
    torch.manual_seed(3)
    F.dropout(F.relu(x), 0.5, True)
    after_ref = torch.rand(4)
    torch.manual_seed(3)
    relu_dropout(x.requires_grad_(True), 0.5, True, impl="fast")
    assert torch.equal(torch.rand(4), after_ref)
    torch.manual_seed(3)
    F.dropout(x, 0.5, True)
    after_ref = torch.rand(4)
    torch.manual_seed(3)
    dropout(x, 0.5, True, impl="fast")
    assert torch.equal(torch.rand(4), after_ref)


def test_fast_paths_keep_less_for_backward():
    x = torch.randn(64, 128, requires_grad=True)
    _, ref = _saved_bytes(lambda t: F.dropout(t, 0.1, True), x)
    _, fast = _saved_bytes(lambda t: dropout(t, 0.1, True, impl="fast"), x)
    assert ref == 64 * 128 * 4 and fast == 64 * 128  # float mask -> bool mask
    _, ref = _saved_bytes(lambda t: F.dropout(F.relu(t), 0.1, True), x)
    y, fast = _saved_bytes(lambda t: relu_dropout(t, 0.1, True, impl="fast"), x)
    assert ref == 2 * 64 * 128 * 4 and fast == 64 * 128 * 4  # only y, which a Linear keeps anyway
    assert y.requires_grad


@pytest.mark.parametrize("p,training", [(0.0, True), (0.3, False), (1.0, True)])
def test_inactive_dropout_is_torchs(p, training):
    x = torch.randn(5, 7, requires_grad=True)
    assert torch.equal(dropout(x, p, training, impl="fast"), F.dropout(x, p, training))
    assert torch.equal(relu_dropout(x, p, training, impl="fast"),
                       F.dropout(F.relu(x), p, training))


def test_bad_arguments():
    x = torch.randn(3)
    with pytest.raises(ValueError, match="impl"):
        dropout(x, 0.1, impl="fused")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        relu_dropout(x, 1.5)
