"""MoH (arXiv 2410.11842v3, Sec. 3.2, Eqs. 4-7; the query-norm router of Sec. 4.4, Eq. 9)
against the independent float64 transcription in tests/references.py (``ref_moh``): outputs,
the load-balance loss and every gradient, over the shared / routed splits, both routers, both
weightings, RoPE or no positions, grouped-query attention and biases; cached decoding against
the full forward; the zero-router layer with every head active against dense attention;
padding; the config's checks.

Shape legend: B batch, T tokens, D d_model, H heads, G key/value heads, C d_head.
"""

import pytest
import torch

from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.moh import MoHConfig
from references import ref_moh

f64 = torch.float64
D, H, C = 12, 6, 4

pytestmark = pytest.mark.usefixtures("single_thread")


def make(seed=0, **kw):
    torch.manual_seed(seed)
    kw = {"n_shared": 2, "k": 2, "pos": "rope", "n_layers": 2, "balance_coef": 1.0, **kw}
    m = MoHConfig(d_model=D, n_heads=H, d_head=C, **kw).build().double()
    with torch.no_grad():  # biases non-zero, so that their gradients and use are checked
        for name in ("bias_q", "bias_k", "bias_v", "bias_o"):
            if hasattr(m, name):
                getattr(m, name).normal_()
    return m


def heads(w, n):
    """[D, n·C] -> [n, D, C]."""
    return w.reshape(w.shape[0], n, C).permute(1, 0, 2)


def reference(m, x, causal=True):
    c = m.config
    G = c.kv_heads
    kw = dict(n_shared=c.n_shared, k=c.k, router=c.router, weights=c.weights,
              n_rot=C // 2 if c.pos == "rope" else 0, causal=causal,
              w_r=getattr(m, "w_router", None), w_s=getattr(m, "w_router_shared", None),
              w_h=getattr(m, "w_router_type", None))
    if c.qkv_bias:
        kw.update(b_q=m.bias_q.view(H, C)[:, None, None], b_k=m.bias_k.view(G, C)[:, None, None],
                  b_v=m.bias_v.view(G, C)[:, None, None])
    if c.out_bias:
        kw["b_o"] = m.bias_o
    return ref_moh(x, heads(m.w_q, H), heads(m.w_k, G), heads(m.w_v, G),
                   m.w_o.view(H, C, D), **kw)


CASES = [
    dict(),                                            # 2 shared + 2 of 4 routed
    dict(weights="paper"),                             # Eqs. 5-6 as printed
    dict(n_shared=0, k=3),                             # routed only (no W_h)
    dict(n_shared=1, k=2),                             # one shared head (no W_s)
    dict(n_shared=6, k=0),                             # every head shared, softmax-weighted
    dict(n_shared=2, k=4),                             # every routed head kept
    dict(router="query_norm", n_shared=2, k=2),        # the authors' LLaMA3 router
    dict(n_kv_heads=2, qkv_bias=True, out_bias=True),  # grouped-query attention, biases
    dict(pos="none"),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items())
                         or "default")
def test_matches_reference_outputs_loss_and_gradients(kw):
    m = make(**kw)
    x = torch.randn(2, 7, D, dtype=f64, requires_grad=True)
    causal = kw.get("pos") != "none"  # the authors' layer is bidirectional: check that too
    y, aux = m(x, causal=causal)
    x_ref = x.detach().clone().requires_grad_()
    y_ref, loss_ref = reference(m, x_ref, causal)
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    total = (y * g).sum()
    if loss_ref is None:
        assert "balance" not in aux.losses
    else:
        torch.testing.assert_close(aux.losses["balance"], loss_ref)
        total = total + aux.losses["balance"]
    params = dict(m.named_parameters())
    grads = torch.autograd.grad(total, [x, *params.values()], allow_unused=True)
    ref_total = (y_ref * g).sum() + (0 if loss_ref is None else loss_ref)
    ref_grads = torch.autograd.grad(ref_total, [x_ref, *params.values()], allow_unused=True)
    for name, a, b in zip(["x", *params], grads, ref_grads):
        if b is None:  # the query-norm router's unused nothing, an all-shared layer's W_r
            assert a is None or not a.any(), name
        else:
            torch.testing.assert_close(a, b, msg=lambda s: f"{name}: {s}")


def test_router_choice_and_aux_records():
    m = make(n_shared=2, k=2)
    x = torch.randn(2, 5, D, dtype=f64)
    _, aux = m.train()(x)
    rec = aux.routing["router"]
    assert rec.counts.shape == (1, H - 2) and int(rec.counts.sum()) == 2 * 5 * 2
    assert int(m.usage.sum()) == 2 * 5 * 2
    m.eval()(x)
    assert int(m.usage.sum()) == 2 * 5 * 2  # evaluation leaves the running counts alone


@pytest.mark.parametrize("kw", [dict(), dict(router="query_norm", n_kv_heads=3),
                                 dict(pos="xl")])
def test_cached_decoding_equals_full_forward(kw):
    m = make(**kw).eval()
    x = torch.randn(2, 9, D, dtype=f64)
    with torch.no_grad():
        full, _ = m(x)
        cache = m.new_cache()
        steps = [m(x[:, :4], cache=cache)[0]] + [m(x[:, t:t + 1], cache=cache)[0]
                                                  for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full)


@pytest.mark.parametrize("pos", ["rope", "xl"])
def test_zero_router_with_every_head_active_is_dense_attention(pos):
    dense = DenseAttentionConfig(d_model=D, n_heads=H, d_head=C, pos=pos).build().double()
    m = make(n_shared=2, k=4, pos=pos, weights="authors")
    with torch.no_grad():
        for name in ("w_router", "w_router_shared", "w_router_type"):
            getattr(m, name).zero_()
        m.load_state_dict(dense.state_dict(), strict=False)
        if pos == "xl":
            dense.core.bias_u.normal_()
            m.core.bias_u.copy_(dense.core.bias_u)
    x = torch.randn(2, 6, D, dtype=f64)
    mem = torch.randn(2, 3, D, dtype=f64) if pos == "xl" else None
    kv = None if mem is None else torch.cat([mem, x], 1)
    torch.testing.assert_close(m(x, kv)[0], dense(x, kv)[0])


def test_padding_is_left_out_of_the_loss_and_counts():
    m = make()
    x = torch.randn(1, 6, D, dtype=f64)
    valid = torch.tensor([[True] * 4 + [False] * 2])
    y, aux = m(x, valid_k=valid)
    y4, aux4 = m(x[:, :4])
    torch.testing.assert_close(y[:, :4], y4)
    torch.testing.assert_close(aux.losses["balance"], aux4.losses["balance"])
    assert int(aux.routing["router"].counts.sum()) == 4 * 2


def test_param_count_matches_module():
    for kw in CASES + [dict(pos="xl")]:
        m = make(**kw)
        assert m.param_count() == sum(p.numel() for p in m.parameters()), kw


@pytest.mark.parametrize("kw,match", [
    (dict(n_shared=7), "n_shared=7 exceeds n_heads=6"),
    (dict(k=5), "k must lie in \\[1, 4\\]"),
    (dict(k=0), "k must lie in \\[1, 4\\]"),
    (dict(n_shared=6, k=1), "k must be 0 when every head is shared"),
    (dict(router="topk"), "router must be one of"),
    (dict(weights="mine"), "weights must be one of"),
    (dict(router="query_norm", n_shared=5, k=1), "at least 2 routed heads"),
    (dict(n_kv_heads=4), "n_kv_heads must be a positive divisor"),
    (dict(balance_coef=-1.0), "balance_coef must be >= 0"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        MoHConfig(d_model=D, n_heads=H, d_head=C, **{"n_shared": 2, "k": 2, **kw})
