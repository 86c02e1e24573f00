"""Upcycling dense attention into MoH (moeify.models.upcycle.attention.to_moh): with every routed
head kept and a zero (or the query-norm) router the logits are the dense model's, for moeify's
XL and RoPE attention and for imported grouped-query attention with biases; with fewer heads
kept, each token keeps its shared heads and its routed heads exactly and loses the others'
terms (against the dense layer with the dropped heads' output rows zeroed); bad specs are
one-line errors; ``is_exact`` says so only where it holds.

Shape legend: B batch, T tokens, D d_model, H heads, C d_head.
"""

import dataclasses

import pytest
import torch

from moeify.layers.gqa import GroupedQueryAttentionConfig
from moeify.layers.mlp import GatedMLPConfig
from moeify.layers.moh import MoHAttention
from moeify.layers.norm import NormConfig
from moeify.models.config import ModelConfig
from moeify.models.presets import dense_attn, dense_ff
from moeify.models.upcycle import is_exact, upcycle
from moeify.models.upcycle.attention import to_moh

pytestmark = pytest.mark.usefixtures("single_thread")

D, H, C, L, T, V = 16, 4, 4, 2, 10, 50


def dense_model(pos="rope", xl=False):
    cfg = ModelConfig(vocab_size=V, d_model=D, n_layers=L, context_length=T,
                      attention=dense_attn(d=D, L=L, H=H, d_h=C, pos=pos),
                      feedforward=dense_ff(d=D, L=L, d_ff=32, dropout=0.0), xl_memory=xl)
    torch.manual_seed(0)
    m = cfg.build()
    with torch.no_grad():  # non-zero XL biases, so that their copy is checked
        for b in m.blocks:
            if pos == "xl":
                b.attention.core.bias_u.normal_(0, 0.3)
                b.attention.core.bias_v.normal_(0, 0.3)
    # float32 values in float64: the upcycled model (built in float32) holds them exactly
    return m.double().eval()


def imported_model():
    """A Llama-like model with grouped-query attention (2 key/value heads) and Qwen2's biases."""
    att = GroupedQueryAttentionConfig(d_model=D, n_heads=H, n_kv_heads=2, d_head=C, pos="rope",
                                      qkv_bias=True, out_bias=True, n_layers=L)
    cfg = ModelConfig(vocab_size=V, d_model=D, n_layers=L, context_length=T, attention=att,
                      feedforward=GatedMLPConfig(d_model=D, d_ff=32, n_layers=L),
                      xl_memory=False, norm=NormConfig(kind="rmsnorm", bias=False),
                      output_bias=False)
    torch.manual_seed(0)
    m = cfg.build()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".bias" in name:
                p.normal_(0, 0.3)
    return m.double().eval()


def ids():
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("make,spec", [
    (lambda: dense_model("rope"), "moh:shared=1,k=3,router_scale=0"),
    (lambda: dense_model("xl", xl=True), "moh:shared=2,k=2,router_scale=0"),
    (lambda: dense_model("rope"), "moh:shared=0,k=4,router=query_norm"),
    (imported_model, "moh:shared=2,k=2,router_scale=0"),
    (imported_model, "moh:shared=1,k=3,router=query_norm"),
])
def test_every_head_kept_is_exact(make, spec):
    dense = make()
    moh = upcycle(dense, attention=spec).double().eval()
    assert all(isinstance(b.attention, MoHAttention) for b in moh.blocks)
    x = ids()
    torch.testing.assert_close(moh(x).logits, dense(x).logits, rtol=0, atol=1e-12)
    assert is_exact(spec, source=dense.config)
    # dense is left untouched
    assert not any(isinstance(b.attention, MoHAttention) for b in dense.blocks)


def test_fewer_heads_keep_their_terms_exactly():
    """k < routed heads, zero router: every token keeps the shared heads and the first k routed
    ones (ties go to the lowest index), each with gate 1: the dense layer with the other heads'
    W_O rows zeroed."""
    dense = dense_model("rope")
    attn = dense.blocks[0].attention
    moh = to_moh(attn, shared=1, k=1, router_scale=0.0).double()
    pruned = dataclasses.replace(attn.config).build().double()
    pruned.load_state_dict(attn.state_dict())
    with torch.no_grad():
        pruned.w_o[2 * C:] = 0.0  # heads 2, 3 dropped: kept are shared 0 and routed 1
    x = torch.randn(2, T, D, dtype=torch.float64)
    torch.testing.assert_close(moh(x)[0], pruned(x)[0], rtol=0, atol=1e-12)
    assert not is_exact("moh:shared=1,k=1,router_scale=0", source=dense.config)
    assert not is_exact("moh:shared=1,k=3", source=dense.config)  # router_scale 0.1


def test_a_small_router_keeps_the_gates_near_one():
    dense = dense_model("rope")
    moh = to_moh(dense.blocks[0].attention, shared=1, k=2, router_scale=0.1, seed=3).double()
    x = torch.randn(2, T, D, dtype=torch.float64)
    g = moh._route(x.reshape(-1, D), moh._qkv(x, None)[0])[0]
    active = g[g > 0]
    # logits of std about router_scale for unit-variance inputs: gates 1 ± a few router_scales
    assert active.numel() == 2 * T * 3
    assert (active - 1).abs().max() < 0.3 and (active - 1).abs().mean() < 0.1


@pytest.mark.parametrize("spec,match", [
    ("moh:k=2", "give shared"),
    ("moh:shared=4,k=1", "shared must be an integer in \\[0, 3\\]"),
    ("moh:shared=1,k=4", "k must lie in \\[1, 3\\]"),
    ("moh:shared=1,k=2,router=hash", "router must be one of"),
    ("moh:shared=1,k=2,router_scale=-1", "router_scale must be >= 0"),
])
def test_bad_specs_are_one_line_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        upcycle(dense_model("rope"), attention=spec)


def test_qk_norm_is_refused():
    att = GroupedQueryAttentionConfig(d_model=D, n_heads=H, n_kv_heads=H, d_head=C,
                                      qk_norm="head")
    with pytest.raises(ValueError, match="Q/K normalisation"):
        to_moh(att.build(), shared=1, k=2)
