"""The attention core (ops/attention.py) and the dense baselines (layers/attention.py) against an
independent transcription: explicit softmax over a mask written from positions here, RoPE as a
complex rotation, XL as the sinusoid of every pairwise distance (those two from references.py).

Shape legend: B batch, H heads, T queries, S sources, C d_head, D d_model.
"""

import math

import pytest
import torch

from moeify.layers.attention import DenseAttention, DenseAttentionConfig
from moeify.ops.attention import attend, build_mask
from references import ref_positions, ref_rope, ref_softmax_attention, ref_xl

f64 = torch.float64


pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------- transcription


def dense_reference(m, xq, xkv=None, *, causal=True, pos_q=None, pos_k=None, valid_k=None):
    """The dense baseline written out: Q, K, V per head; RoPE / XL (u, v, learned scale) / none;
    heads concatenated through W_O."""
    c = m.config
    H, C, D = c.n_heads, c.d_head, c.d_model
    xs = xq if xkv is None else xkv
    B, T, S = xq.shape[0], xq.shape[1], xs.shape[1]
    if xkv is None and pos_k is None:
        pos_k = pos_q
    pq, pk = ref_positions(B, T, S, pos_q, pos_k)
    q = torch.einsum("btd,dhc->bhtc", xq, m.w_q.view(D, H, C))
    k = torch.einsum("bsd,dhc->bhsc", xs, m.w_k.view(D, H, C))
    v = torch.einsum("bsd,dhc->bhsc", xs, m.w_v.view(D, H, C))
    if c.pos == "xl":
        logits = m.core.scale * (torch.einsum("bhtc,bhsc->bhts", q + m.core.bias_u[:, None], k)
                            + ref_xl(q + m.core.bias_v[:, None], m.core.w_pos.view(D, H, C), pq, pk))
    else:
        if c.pos == "rope":
            q, k = ref_rope(q, pq, C // 2 - (C // 2) % 2), ref_rope(k, pk, C // 2 - (C // 2) % 2)
        logits = torch.einsum("bhtc,bhsc->bhts", q, k) / math.sqrt(C)
    o = ref_softmax_attention(logits, v, pq, pk, causal, valid_k)
    return torch.einsum("bhtc,hcd->btd", o, m.w_o.view(H, C, D))


def assert_same_with_grads(fn_a, fn_b, tensors, rtol=1e-9, atol=1e-10):
    ya, yb = fn_a(), fn_b()
    torch.testing.assert_close(ya, yb, rtol=rtol, atol=atol)
    g = torch.randn_like(ya)
    ga = torch.autograd.grad((ya * g).sum(), tensors, allow_unused=True)
    gb = torch.autograd.grad((yb * g).sum(), tensors, allow_unused=True)
    for a, b in zip(ga, gb):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------- the core


CORE_CASES = {
    "causal_square": dict(T=5, S=5, causal=True),
    "causal_memory": dict(T=3, S=7, causal=True),
    "cross": dict(T=4, S=6, causal=False),
    "causal_valid": dict(T=5, S=5, causal=True, valid=True),
    "explicit_positions": dict(T=4, S=6, causal=True, explicit=True),
    "more_queries_than_keys": dict(T=6, S=3, causal=True),
}


@pytest.mark.parametrize("case", list(CORE_CASES))
@pytest.mark.parametrize("kv_heads", [3, 1])
def test_core_auto_and_reference_match_transcription(case, kv_heads):
    spec = CORE_CASES[case]
    torch.manual_seed(0)
    B, H, C, T, S = 2, 3, 4, spec["T"], spec["S"]
    q = torch.randn(B, H, T, C, dtype=f64, requires_grad=True)
    k = torch.randn(B, kv_heads, S, C, dtype=f64, requires_grad=True)
    v = torch.randn(B, kv_heads, S, C, dtype=f64, requires_grad=True)
    pq, pk = ref_positions(B, T, S)
    kw = {}
    if spec.get("explicit"):
        pq = torch.tensor([[3, 8, 9, 20], [0, 2, 4, 6]])
        pk = torch.tensor([[1, 3, 5, 8, 9, 30], [0, 1, 2, 3, 4, 5]])
        kw = dict(pos_q_BT=pq, pos_k_BS=pk)
    valid = None
    if spec.get("valid"):
        valid = torch.tensor([[False, True, True, False, True], [True] * 5])
        kw["valid_k_BS"] = valid
    mask = build_mask(T, S, causal=spec["causal"], **kw)
    scale = 1 / math.sqrt(C)

    def ref():
        logits = scale * q @ k.transpose(-1, -2)
        return ref_softmax_attention(logits, v, pq, pk, spec["causal"], valid)

    for impl in ("auto", "reference"):
        assert_same_with_grads(lambda: attend(q, k, v, mask, scale=scale, impl=impl), ref,
                               (q, k, v))


def test_core_empty_rows_are_zero_with_finite_gradients():
    torch.manual_seed(1)
    q = torch.randn(1, 2, 3, 4, dtype=f64, requires_grad=True)
    k = torch.randn(1, 2, 3, 4, dtype=f64, requires_grad=True)
    v = torch.randn(1, 2, 3, 4, dtype=f64, requires_grad=True)
    mask = build_mask(3, 3, causal=True, valid_k_BS=torch.tensor([[False, True, True]]))
    for impl in ("auto", "reference"):
        out = attend(q, k, v, mask, scale=0.5, impl=impl)
        assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
        q.grad = k.grad = v.grad = None


def test_core_bias_and_tensor_scale_take_the_explicit_path():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=f64) for _ in range(3))
    bias = torch.randn(1, 2, 4, 4, dtype=f64)
    scale = torch.tensor(0.7, dtype=f64, requires_grad=True)
    mask = build_mask(4, 4, causal=True)
    out = attend(q, k, v, mask, scale=scale, bias_BHTS=bias)
    logits = (0.7 * q @ k.transpose(-1, -2) + bias).masked_fill(
        ~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v)
    out.sum().backward()
    assert scale.grad is not None
    with pytest.raises(ValueError, match="implementation"):
        attend(q, k, v, mask, scale=1.0, impl="flash")


# ---------------------------------------------------------------------------- the layer


def make(pos, **kw):
    torch.manual_seed(3)
    cfg = DenseAttentionConfig(d_model=10, n_heads=2, d_head=6, pos=pos, n_layers=4, **kw)
    m = cfg.build().double()
    with torch.no_grad():  # non-zero u, v and an off-default scale so that they are exercised
        if pos == "xl":
            m.core.bias_u.normal_()
            m.core.bias_v.normal_()
            m.core.scale.fill_(0.3)
    return m


@pytest.mark.parametrize("pos", ["xl", "rope", "none"])
@pytest.mark.parametrize("setting", ["self", "memory", "cross", "explicit", "valid"])
def test_dense_matches_transcription(pos, setting):
    m = make(pos)
    torch.manual_seed(4)
    B, T, M, D = 2, 4, 3, 10
    x = torch.randn(B, T, D, dtype=f64, requires_grad=True)
    kv, kw = None, {}
    if setting == "memory":
        kv = torch.cat([torch.randn(B, M, D, dtype=f64), x], 1)
    elif setting == "cross":
        kv = torch.randn(B, 6, D, dtype=f64, requires_grad=True)
        kw = dict(causal=False)
    elif setting == "explicit":
        kw = dict(pos_q=torch.tensor([[2, 5, 6, 11], [0, 1, 9, 10]]))
    elif setting == "valid":
        kw = dict(valid_k=torch.tensor([[True, False, True, True], [True] * 4]))
    params = tuple(m.parameters())
    inputs = (x,) + ((kv,) if setting == "cross" else ())
    assert_same_with_grads(lambda: m(x, kv, **kw)[0], lambda: dense_reference(m, x, kv, **kw),
                           params + inputs)


@pytest.mark.parametrize("pos", ["xl", "rope", "none"])
def test_dense_reference_core_equals_auto(pos):
    a = make(pos)
    b = make(pos, attn_impl="reference")
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, 10, dtype=f64)
    torch.testing.assert_close(a(x)[0], b(x)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pos", ["xl", "rope", "none"])
def test_dense_causality(pos):
    m = make(pos)
    x = torch.randn(1, 6, 10, dtype=f64)
    x2 = x.clone()
    x2[:, 4:] += torch.randn(1, 2, 10, dtype=f64)
    y, y2 = m(x)[0], m(x2)[0]
    torch.testing.assert_close(y[:, :4], y2[:, :4], rtol=0, atol=0)
    assert not torch.allclose(y[:, 4:], y2[:, 4:])


@pytest.mark.parametrize("pos", ["xl", "rope", "none"])
def test_dense_param_count(pos):
    cfg = DenseAttentionConfig(d_model=12, n_heads=3, d_head=5, pos=pos)
    assert cfg.build().param_count() == sum(p.numel() for p in cfg.build().parameters())
    assert cfg.build().new_cache().length == 0


def test_dense_xl_47m_layer_params():
    # WT103 47M dense XL (SwitchHead Table 9): 5·d·H·d_h + 2·H·d_h + 1 = 845,421 per layer. The
    # authors'
    # model total 47,260,136 is 16 more: their module holds one unused scalar per layer.
    cfg = DenseAttentionConfig(d_model=412, n_heads=10, d_head=41, pos="xl", n_layers=16)
    assert cfg.param_count() == 845_421


def test_dense_init_follows_spec():
    cfg = DenseAttentionConfig(d_model=256, n_heads=4, d_head=64, pos="xl", n_layers=8)
    m = cfg.build()
    target = math.sqrt(2 / (8 * 256))
    # The authors' init: a normal truncated at ±2 (actual std 0.8796) rescaled to std exactly
    # the target, so no value exceeds 2 / 0.8796 ≈ 2.27 targets (up to sampling).
    assert m.w_q.std().item() == pytest.approx(target, rel=1e-5)
    assert m.w_q.abs().max().item() <= 2.35 * target
    assert m.w_o.std().item() == pytest.approx(target, rel=1e-5)
    assert m.core.w_pos.std().item() == pytest.approx(target, rel=1e-5)
    assert torch.all(m.core.bias_u == 0) and m.core.scale.item() == pytest.approx(1 / 8)


@pytest.mark.parametrize("kw,msg", [
    (dict(n_heads=0), "n_heads"),
    (dict(d_head=-1), "d_head"),
    (dict(n_layers=0), "n_layers"),
    (dict(pos="alibi"), "pos"),
    (dict(attn_dropout=1.0), "attn_dropout"),
    (dict(attn_impl="flash"), "attn_impl"),
])
def test_dense_config_validation(kw, msg):
    base = dict(d_model=8, n_heads=2, d_head=4)
    with pytest.raises(ValueError, match=msg):
        DenseAttentionConfig(**{**base, **kw})


def test_dense_input_validation():
    m = DenseAttentionConfig(d_model=8, n_heads=2, d_head=4, pos="rope").build()
    with pytest.raises(ValueError, match="d_model"):
        m(torch.randn(1, 3, 7))
    with pytest.raises(ValueError, match="pos_q"):
        m(torch.randn(1, 3, 8), pos_q=torch.arange(4)[None])
    with pytest.raises(ValueError, match="valid_k"):
        m(torch.randn(1, 3, 8), valid_k=torch.ones(1, 2, dtype=torch.bool))


def test_dense_attention_dropout_only_in_training():
    m = make("rope", attn_dropout=0.5)
    x = torch.randn(1, 5, 10, dtype=f64)
    m.eval()
    torch.testing.assert_close(m(x)[0], dense_reference(m, x))
    m.train()
    assert not torch.allclose(m(x)[0], dense_reference(m, x))
    assert isinstance(m, DenseAttention)


def test_project_by_input_groups_pieces_of_the_same_input():
    from moeify.layers.projection import project_by_input

    g = torch.Generator().manual_seed(0)
    x, z = torch.randn(2, 3, 5, generator=g, dtype=f64), torch.randn(2, 4, 5, generator=g,
                                                                      dtype=f64)
    w = {n: torch.randn(5, m, generator=g, dtype=f64) for n, m in (("a", 3), ("b", 2), ("c", 4))}
    out = project_by_input([("a", x, w["a"]), ("b", z, w["b"]), ("c", x, w["c"])])
    for n, inp in (("a", x), ("b", z), ("c", x)):
        torch.testing.assert_close(out[n], inp @ w[n], rtol=1e-12, atol=1e-12)
    # a and c read the same tensor: views into one product
    assert out["a"].untyped_storage().data_ptr() == out["c"].untyped_storage().data_ptr()
    assert out["b"].untyped_storage().data_ptr() != out["a"].untyped_storage().data_ptr()


def test_project_by_input_keeps_fused_weights_only_without_gradients():
    from moeify.layers.projection import project_by_input

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, generator=g, dtype=f64)
    wa = torch.randn(5, 3, generator=g, dtype=f64, requires_grad=True)
    wb = torch.randn(5, 2, generator=g, dtype=f64, requires_grad=True)
    memo = {}
    out = project_by_input([("a", x, wa), ("b", x, wb)], memo)
    out["a"].sum().backward()  # with gradients: nothing kept, gradients flow
    assert not memo and wa.grad is not None
    with torch.no_grad():
        first = project_by_input([("a", x, wa), ("b", x, wb)], memo)
        (fused,) = [v[1] for v in memo.values()]
        again = project_by_input([("a", x, wa), ("b", x, wb)], memo)
        assert [v[1] for v in memo.values()] == [fused]  # reused, not rebuilt
        torch.testing.assert_close(again["b"], x @ wb, rtol=1e-12, atol=1e-12)
        wb.add_(1.0)  # an in-place update: rebuilt from the new weights
        torch.testing.assert_close(project_by_input([("a", x, wa), ("b", x, wb)], memo)["b"],
                                   x @ wb, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(first["a"], x @ wa.detach(), rtol=1e-12, atol=1e-12)
    project_by_input([("a", x, wa), ("b", x, wb)], memo)  # training again: the copy is dropped
    assert not memo
