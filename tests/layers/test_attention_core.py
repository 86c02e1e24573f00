"""The attention core (layers/attention_core.py) against the independent transcriptions of
references.py, in float64: every positional variant, grouped-query attention, RoPE fraction and
base, XL with and without learned biases; forward and gradients; cached decoding.

Shape legend: B batch, H query heads, G key/value heads, T queries, S sources, C d_head, D width.
"""

import math

import pytest
import torch

from moeify.layers.attention_core import AttentionCore, AttentionCoreConfig
from moeify.layers.kv_cache import KVCache
from references import ref_positions, ref_rope, ref_softmax_attention, ref_xl

f64 = torch.float64
B, T, D, C = 2, 7, 10, 6

pytestmark = pytest.mark.usefixtures("single_thread")


def build(pos, *, H=4, G=None, xl_heads=None, xl_biases=False, **kw):
    torch.manual_seed(0)
    core = AttentionCore(AttentionCoreConfig(d_model=D, n_heads=H, d_head=C, n_kv_heads=G,
                                             pos=pos, xl_heads=xl_heads, xl_biases=xl_biases,
                                             **kw)).double()
    with torch.no_grad():
        for p in core.parameters():
            p.normal_()
    return core


def core_reference(core, q, k, v, *, causal=True, pos_q=None, pos_k=None, valid_k=None):
    """Written out: positions, RoPE / XL / nothing, key/value head h // (H / G), masked softmax."""
    c = core.config
    H, S = q.shape[1], k.shape[2]
    G = k.shape[1]
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    pq, pk = ref_positions(q.shape[0], q.shape[2], S, pos_q, pos_k)
    if c.pos == "rope":
        n = int(c.rope_fraction * C) // 2 * 2
        q, k = ref_rope(q, pq, n, c.rope_base), ref_rope(k, pk, n, c.rope_base)
    scale = core.scale if c.xl_biases else 1 / math.sqrt(C)
    u = core.bias_u[:, None] if c.xl_biases else 0.0
    vb = core.bias_v[:, None] if c.xl_biases else 0.0
    logits = torch.einsum("bhtc,bhsc->bhts", q + u, k)
    if c.pos == "xl":
        w = core.w_pos.view(D, c.pos_heads, C).expand(D, H, C)
        logits = logits + ref_xl(q + vb, w, pq, pk)
    return ref_softmax_attention(logits * scale, v, pq, pk, causal, valid_k)


CASES = [
    dict(pos="xl"), dict(pos="xl", xl_biases=True), dict(pos="xl", G=1, xl_heads=1),
    dict(pos="xl", G=2), dict(pos="rope"), dict(pos="rope", rope_fraction=1.0, rope_base=500.0),
    dict(pos="rope", G=2), dict(pos="none", G=1), dict(pos="absolute"),
]


@pytest.mark.parametrize("impl", ["auto", "reference"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_core_equals_reference_forward_and_gradients(case, impl):
    core = build(**case, attn_impl=impl)
    H, G = core.config.n_heads, core.config.kv_heads
    q = torch.randn(B, H, T, C, dtype=f64, requires_grad=True)
    k = torch.randn(B, G, T, C, dtype=f64, requires_grad=True)
    v = torch.randn(B, G, T, C, dtype=f64, requires_grad=True)
    valid = torch.rand(B, T) > 0.3
    for kw in (dict(), dict(valid_k=valid), dict(causal=False)):
        out, ref = core(q, k, v, **kw), core_reference(core, q, k, v, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        g = torch.randn_like(out)
        tensors = [q, k, v] + list(core.parameters())
        ga = torch.autograd.grad((out * g).sum(), tensors)
        gb = torch.autograd.grad((ref * g).sum(), tensors)
        for a, b in zip(ga, gb):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("case", [dict(pos="xl", G=2), dict(pos="rope", G=2), dict(pos="none")])
def test_grouped_query_decoding_equals_full_forward(case):
    core = build(**case).eval()
    H, G = core.config.n_heads, core.config.kv_heads
    q = torch.randn(B, H, T, C, dtype=f64)
    k, v = torch.randn(B, G, T, C, dtype=f64), torch.randn(B, G, T, C, dtype=f64)
    with torch.no_grad():
        full = core(q, k, v)
        cache = KVCache()
        steps = [core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache=cache)
                 for t in range(T)]
    assert cache.keys.shape[1] == G  # the cache stores the key/value heads, not H
    torch.testing.assert_close(torch.cat(steps, 2), full, rtol=1e-10, atol=1e-12)


def test_probs_sum_to_one_and_weight_the_values():
    core = build("xl", G=2)
    q = torch.randn(B, 4, T, C, dtype=f64)
    k, v = torch.randn(B, 2, T, C, dtype=f64), torch.randn(B, 2, T, C, dtype=f64)
    p = core.probs(q, k)
    torch.testing.assert_close(p.sum(-1), torch.ones(B, 4, T, dtype=f64))
    torch.testing.assert_close(p @ v.repeat_interleave(2, 1), core(q, k, v))


@pytest.mark.parametrize("bad", [dict(n_kv_heads=3), dict(n_kv_heads=0), dict(pos="alibi"),
                                 dict(rope_fraction=1.5), dict(attn_dropout=1.0)])
def test_bad_core_config_is_a_value_error(bad):
    kw = dict(d_model=D, n_heads=4, d_head=C) | bad
    with pytest.raises(ValueError):
        AttentionCoreConfig(**kw)


def test_param_count_matches_the_module():
    for case in CASES:
        core = build(**case)
        assert core.config.param_count() == sum(p.numel() for p in core.parameters())
