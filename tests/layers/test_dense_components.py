"""The dense components of the Hugging Face families (layers/norm.py, mlp.py, gqa.py) against
plain formulas written here."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moeify.layers.gqa import GroupedQueryAttentionConfig
from moeify.layers.mlp import GatedMLPConfig, MLPConfig
from moeify.layers.norm import NormConfig
from moeify.ops.positional import apply_rope

pytestmark = pytest.mark.usefixtures("single_thread")


def test_rmsnorm_and_layernorm_formulas():
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    rms = NormConfig(kind="rmsnorm", eps=1e-3, bias=False).build(16).double()
    torch.nn.init.normal_(rms.weight)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3) * rms.weight
    assert torch.allclose(rms(x), want)
    ln = NormConfig(eps=1e-3).build(16).double()
    assert ln.eps == 1e-3 and ln.bias is not None
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        NormConfig(kind="rmsnorm")


def test_mlp_activations():
    x = torch.randn(2, 3, 8)
    mlp = MLPConfig(d_model=8, d_ff=16, activation="gelu_tanh").build()
    h = mlp.w1(x)
    tanh_gelu = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    assert torch.allclose(mlp(x)[0], mlp.w2(tanh_gelu), atol=1e-6)
    glu = GatedMLPConfig(d_model=8, d_ff=16).build()
    assert glu.w_up.bias is None
    want = glu.w_down(glu.w_gate(x) * torch.sigmoid(glu.w_gate(x)) * glu.w_up(x))
    assert torch.allclose(glu(x)[0], want, atol=1e-6)


def _naive_gqa(layer, x, valid=None):
    """Per-head loop: head h reads key/value head h // (H / Hk); full-width rotate-half RoPE."""
    c = layer.config
    B, T, _ = x.shape
    q = layer.w_q(x).view(B, T, c.n_heads, c.d_head).transpose(1, 2)
    k = layer.w_k(x).view(B, T, c.n_kv_heads, c.d_head).transpose(1, 2)
    v = layer.w_v(x).view(B, T, c.n_kv_heads, c.d_head).transpose(1, 2)
    pos = torch.arange(T)
    q, k = apply_rope(q, pos, n_rot=c.d_head, base=c.rope_base), \
        apply_rope(k, pos, n_rot=c.d_head, base=c.rope_base)
    allowed = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    if valid is not None:
        allowed = allowed & valid[:, None, :]
    outs = []
    for h in range(c.n_heads):
        g = h // (c.n_heads // c.n_kv_heads)
        logits = q[:, h] @ k[:, g].transpose(-1, -2) / math.sqrt(c.d_head)
        probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
        outs.append(probs @ v[:, g])
    return layer.w_o(torch.stack(outs, 2).reshape(B, T, -1))


@pytest.mark.parametrize("Hk", [1, 2, 4])
def test_gqa_matches_a_per_head_loop_forward_and_backward(Hk):
    torch.manual_seed(0)
    cfg = GroupedQueryAttentionConfig(d_model=16, n_heads=4, n_kv_heads=Hk, d_head=8,
                                      rope_base=100.0, qkv_bias=True, out_bias=True)
    weights = cfg.build().double().state_dict()
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 5:] = False
    for impl in ("auto", "reference"):
        layer = dataclasses.replace(cfg, attn_impl=impl).build().double()
        layer.load_state_dict(weights)
        got = layer(x, valid_k=valid)[0]
        want = _naive_gqa(layer, x, valid)
        rows = valid  # padded queries are not compared (no consumer reads them)
        assert torch.allclose(got[rows], want[rows], atol=1e-10)
        g_got = torch.autograd.grad(got[rows].sum(), [x, layer.w_k.weight])
        g_want = torch.autograd.grad(want[rows].sum(), [x, layer.w_k.weight])
        for a, b in zip(g_got, g_want):
            assert torch.allclose(a, b, atol=1e-10)


def test_gqa_cached_decoding_stores_the_kv_heads_and_equals_the_full_forward():
    torch.manual_seed(3)
    layer = GroupedQueryAttentionConfig(d_model=16, n_heads=4, n_kv_heads=2, d_head=4,
                                        rope_fraction=0.5, qkv_bias=True).build().double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    cache = layer.new_cache()
    steps = [layer(x[:, :2], cache=cache)[0]] + [layer(x[:, t:t + 1], cache=cache)[0]
                                                 for t in range(2, 6)]
    assert cache.keys.shape == (2, 2, 6, 4)  # Hk heads, not H
    assert torch.allclose(torch.cat(steps, 1), layer(x)[0], atol=1e-10)


def test_gqa_inspect_probabilities_reproduce_the_output():
    torch.manual_seed(1)
    layer = GroupedQueryAttentionConfig(d_model=16, n_heads=4, n_kv_heads=2, d_head=4).build()
    x = torch.randn(1, 6, 16)
    probs = layer.inspect(x)["probs_BHTS"]
    v = layer.w_v(x).view(1, 6, 2, 4).transpose(1, 2).repeat_interleave(2, 1)
    out = layer.w_o((probs @ v).transpose(1, 2).reshape(1, 6, 16))
    assert torch.allclose(out, layer(x)[0], atol=1e-6)
    assert torch.allclose(probs.sum(-1), torch.ones(1, 4, 6))
