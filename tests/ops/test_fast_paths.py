"""The fast paths against their references, outputs and every gradient: the fused
Transformer-XL attention core and the RoPE rotation. (The expert matmul's fast paths:
test_expert_matmul.py.)

Shape legend: B batch, H heads, T queries, S keys, C head channels, D sinusoid width,
R relative distances.
"""

import math

import pytest
import torch

from moeify.ops.attention import attend, build_mask
from moeify.ops.positional import (
    apply_rope,
    rel_shift,
    sinusoidal_embedding,
    xl_logits_contiguous,
    xl_position_table,
)
from moeify.ops.xl_attention import xl_attention
from references import ref_rope as brute_rope

f64 = torch.float64


pytestmark = pytest.mark.usefixtures("single_thread")


def grads(y, inputs, g):
    return torch.autograd.grad((y * g).sum(), inputs, allow_unused=True)


def assert_all_close(a, b, rtol=1e-10, atol=1e-10):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


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
