"""Positional maths against the brute-force transcriptions of references.py.

RoPE: complex rotation of channel pairs (i, i + n/2); XL: the sinusoid of every pairwise distance
p_i - p_j, projected and dotted with the query, one pair at a time (no shift, no identity).
Shape legend: B batch, H heads, T queries, S keys, C head channels, D sinusoid width.
"""

import math

import pytest
import torch

from moeify.ops.positional import (
    XLPositionTableCache,
    apply_rope,
    default_positions,
    rel_shift,
    rope_dims,
    sinusoidal_embedding,
    xl_logits_at,
    xl_logits_contiguous,
    xl_position_table,
)
from references import ref_llama3_freq, ref_yarn_freq
from references import ref_rope as brute_rope
from references import ref_sinusoid as brute_emb
from references import ref_xl as brute_xl

f64 = torch.float64


pytestmark = pytest.mark.usefixtures("single_thread")


def test_rope_dims_rounds_down_to_even():
    assert rope_dims(64) == 32 and rope_dims(41) == 20 and rope_dims(42) == 20
    assert rope_dims(100) == 50 and rope_dims(84) == 42 and rope_dims(8, 1.0) == 8
    assert rope_dims(8, 0.0) == 0
    with pytest.raises(ValueError, match="fraction"):
        rope_dims(8, 1.5)


@pytest.mark.parametrize("C,n_rot", [(8, 4), (10, 4), (6, 6)])
def test_rope_matches_complex_rotation(C, n_rot):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, C, dtype=f64)
    pos = torch.randint(0, 50_000, (2, 5))
    out = apply_rope(x, pos, n_rot=n_rot)
    torch.testing.assert_close(out, brute_rope(x, pos, n_rot), rtol=1e-12, atol=1e-12)
    # Channels past n_rot are untouched; [T] positions broadcast over the batch.
    assert torch.equal(out[..., n_rot:], x[..., n_rot:])
    torch.testing.assert_close(apply_rope(x, pos[0], n_rot=n_rot)[0], out[0])


@pytest.mark.parametrize("kind", ["llama3", "yarn", "linear"])
def test_scaled_rope_matches_the_papers_frequencies_with_gradients(kind):
    from moeify.layers.attention_core import RopeScaling

    torch.manual_seed(2)
    n_rot, base = 16, 500.0
    scaling = RopeScaling(kind=kind, factor=4.0, original_context=16, beta_fast=8.0)
    freq = {"llama3": lambda: ref_llama3_freq(n_rot, base, 4.0, 1.0, 4.0, 16),
            "yarn": lambda: ref_yarn_freq(n_rot, base, 4.0, 16, 8.0, 1.0),
            "linear": lambda: base ** (-2.0 * torch.arange(n_rot // 2, dtype=f64) / n_rot) / 4}
    scale = 0.1 * math.log(4.0) + 1 if kind == "yarn" else 1.0  # YaRN Eq. 22
    x = torch.randn(2, 3, 7, 20, dtype=f64, requires_grad=True)
    pos = torch.randint(0, 200, (2, 7))
    out = apply_rope(x, pos, n_rot=n_rot, base=base, scaling=scaling)
    want = brute_rope(x, pos, n_rot, freq=freq[kind](), scale=scale)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    got_grad, = torch.autograd.grad(out, x, g)
    want_grad, = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


def test_dynamic_rope_is_plain_within_the_original_context():
    from moeify.layers.attention_core import RopeScaling

    x = torch.randn(1, 2, 6, 8, dtype=f64)
    scaling = RopeScaling(kind="dynamic", factor=2.0, original_context=16)
    inside, beyond = torch.arange(6)[None], torch.arange(30, 36)[None]
    torch.testing.assert_close(apply_rope(x, inside, n_rot=8, scaling=scaling),
                               apply_rope(x, inside, n_rot=8), rtol=0, atol=0)
    # Beyond it the base grows to b · (2 · 36 / 16 - 1)^(8 / 6) (dynamic NTK).
    grown = 10000.0 * (2 * 36 / 16 - 1) ** (8 / 6)
    torch.testing.assert_close(apply_rope(x, beyond, n_rot=8, scaling=scaling),
                               brute_rope(x, beyond, 8, base=grown), rtol=1e-12, atol=1e-12)


def test_rope_scores_depend_only_on_distance():
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 8, dtype=f64), torch.randn(1, 1, 1, 8, dtype=f64)

    def score(pq, pk):
        rq = apply_rope(q, torch.tensor([[pq]]), n_rot=4)
        rk = apply_rope(k, torch.tensor([[pk]]), n_rot=4)
        return (rq * rk).sum().item()

    assert score(7, 3) == pytest.approx(score(1007, 1003), abs=1e-9)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-6)


def test_rope_float32_large_positions():
    # Angles in float64: a float32 rotation at position 10^6 keeps float32 accuracy.
    torch.manual_seed(2)
    x = torch.randn(1, 2, 3, 8)
    pos = torch.tensor([[1_000_000, 1_000_001, 2_500_000]])
    ref = brute_rope(x.to(f64), pos, 4)
    torch.testing.assert_close(apply_rope(x, pos, n_rot=4).to(f64), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("D", [8, 7])
def test_sinusoidal_embedding(D):
    dist = torch.tensor([-3, 0, 1, 250])
    torch.testing.assert_close(sinusoidal_embedding(dist, D, f64), brute_emb(dist, D))
    # Spot value: distance 1, frequency 0 -> sin(1), cos(1).
    e = sinusoidal_embedding(torch.tensor([1]), D, f64)[0]
    assert e[0].item() == pytest.approx(math.sin(1.0))
    assert e[(D + 1) // 2].item() == pytest.approx(math.cos(1.0))


def test_rel_shift_definition():
    T, S, R = 3, 5, 7
    x = torch.arange(2 * T * R, dtype=f64).view(1, 2, T, R)
    out = rel_shift(x, S)
    assert out.shape == (1, 2, T, S)
    for i in range(T):
        for j in range(S):
            if j + T - 1 - i < R:
                assert out[0, :, i, j].tolist() == x[0, :, i, j + T - 1 - i].tolist()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,S,D", [(4, 4, 8), (3, 7, 9), (5, 2, 6)])
def test_xl_contiguous_equals_pairwise(causal, T, S, D):
    torch.manual_seed(3)
    B, H, C = 2, 3, 4
    q = torch.randn(B, H, T, C, dtype=f64, requires_grad=True)
    w = torch.randn(D, H, C, dtype=f64, requires_grad=True)
    pq, pk = default_positions(B, T, S, 0, "cpu")
    out = xl_logits_contiguous(q, w, S, causal=causal)
    ref = brute_xl(q, w, pq, pk)
    # Causal: only keys at or before the query are defined (the rest is masked downstream).
    keep = (pk[:, None, :] <= pq[:, :, None])[:, None].expand_as(ref) if causal \
        else torch.ones_like(ref, dtype=torch.bool)
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref) * keep
    ga = torch.autograd.grad((out * g).sum(), (q, w))
    gb = torch.autograd.grad((ref * g).sum(), (q, w))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("D,Hw", [(8, 3), (9, 3), (8, 1)])
def test_xl_explicit_positions_equal_pairwise(D, Hw):
    torch.manual_seed(4)
    B, H, T, S, C = 2, 3, 4, 6, 5
    q = torch.randn(B, H, T, C, dtype=f64, requires_grad=True)
    w = torch.randn(D, Hw, C, dtype=f64, requires_grad=True)
    pq = torch.randint(0, 5000, (B, T))
    pk = torch.randint(0, 5000, (B, S))
    out = xl_logits_at(q, w, pq, pk)
    ref = brute_xl(q, w.expand(D, H, C), pq, pk)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    g = torch.randn_like(ref)
    ga = torch.autograd.grad((out * g).sum(), (q, w))
    gb = torch.autograd.grad((ref * g).sum(), (q, w))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_xl_explicit_equals_shift_on_default_positions_and_float32_precision():
    torch.manual_seed(5)
    B, H, T, S, C, D = 1, 2, 3, 6, 4, 8
    q = torch.randn(B, H, T, C, dtype=f64)
    w = torch.randn(D, H, C, dtype=f64)
    pq, pk = default_positions(B, T, S, 0, "cpu")
    keep = (pk[:, None, :] <= pq[:, :, None])[:, None].expand(B, H, T, S)
    torch.testing.assert_close(xl_logits_at(q, w, pq, pk)[keep],
                               xl_logits_contiguous(q, w, S, causal=True)[keep])
    # Far from the origin in float32 the logits keep float32 accuracy (relative positions small).
    off = 3_000_000
    out32 = xl_logits_at(q.float(), w.float(), pq + off, pk + off).to(f64)
    torch.testing.assert_close(out32, brute_xl(q, w, pq, pk), rtol=0, atol=1e-4)


def test_default_positions():
    pq, pk = default_positions(2, 3, 5, 4, "cpu")
    assert pk.tolist() == [[4, 5, 6, 7, 8]] * 2
    assert pq.tolist() == [[6, 7, 8]] * 2


def test_xl_key_factor_table_gives_the_direct_values():
    # The table of key factors (decoding) must return exactly what the direct computation does,
    # for every width sharing a number of frequencies and beyond the table's first size.
    from moeify.ops.positional import _key_factors, sinusoid_inv_freq

    for D in (7, 8, 412):
        inv = sinusoid_inv_freq(D)
        for dt in (torch.float32, torch.float64):
            pos = torch.tensor([[0, 5, 1023, 1024, 3000], [7, 7, 2, 40000, 1]])
            got = _key_factors(pos, D, inv, dt)
            ang = pos.to(torch.float64)[..., None] * inv
            want = torch.cat([ang.cos(), ang.sin()], -1).to(dt)
            assert torch.equal(got, want)
            assert torch.equal(_key_factors(pos[:, :3], D, inv, dt), want[:, :3])


def test_decoding_position_table_grows_and_equals_the_direct_table():
    # The kept table is the causal table of every length asked for, grown from call to call.
    torch.manual_seed(6)
    w = torch.randn(9, 2, 4, dtype=f64)
    memo = XLPositionTableCache()
    for S in (3, 4, 5, 11, 12, 2):
        want = xl_position_table(w, S, 1, causal=True, dtype=f64)
        torch.testing.assert_close(memo.table(w, S, f64), want, rtol=1e-12, atol=1e-12)
    assert memo._rows_HRC.shape[1] == int(11 * memo.GROWTH)  # amortised, not one row per call
    with torch.no_grad():
        w.mul_(2)  # an in-place update (an optimizer step): the table is rebuilt
    torch.testing.assert_close(memo.table(w, 5, f64), xl_position_table(w, 5, 1, causal=True,
                                                                      dtype=f64))
    other = torch.randn(9, 2, 4, dtype=f64)  # another tensor
    torch.testing.assert_close(memo.table(other, 5, f64),
                               xl_position_table(other, 5, 1, causal=True, dtype=f64))
