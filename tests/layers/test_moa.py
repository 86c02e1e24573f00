"""MoA (Zhang et al. 2022, arXiv 2210.05144) against a transcription written here: every expert's
query and output
projection applied densely, the top-k softmax choice as a 0/1 mask; aux losses by hand.

Shape legend: B batch, T destination tokens, S source tokens, D d_model, E experts, K kept,
C d_head.
"""

import math

import pytest
import torch

from moeify.layers.moa import MoAAttention, MoAConfig
from references import ref_positions, ref_rope, ref_xl

f64 = torch.float64
D, C, E, K = 10, 4, 5, 2


pytestmark = pytest.mark.usefixtures("single_thread")


def moa_reference(m, xq, xkv=None, *, causal=True):
    """y_t = Σ_{e in topk(p_t)} p_t,e · softmax(q_e Kᵀ/sqrt(C)) V W_o^e, computed for all E."""
    c = m.config
    xs = xq if xkv is None else xkv
    B, T, S = xq.shape[0], xq.shape[1], xs.shape[1]
    p = torch.softmax((xq @ m.w_router.t()).float(), -1)  # [B, T, E]
    keep = torch.zeros_like(p).scatter(-1, p.detach().topk(c.k, -1).indices, 1.0)
    gates = p * keep
    if c.renormalize:
        gates = gates / gates.sum(-1, keepdim=True)
    gates = gates.to(xq.dtype)
    q = torch.einsum("btd,edc->betc", xq, m.w_q)  # every expert's query
    k, v = xs @ m.w_k, xs @ m.w_v  # one shared head
    pq, pk = ref_positions(B, T, S)
    if c.pos == "rope":
        q = ref_rope(q, pq, C // 2)
        k = ref_rope(k[:, None], pk, C // 2)[:, 0]
    logits = torch.einsum("betc,bsc->bets", q, k)
    if c.pos == "xl":
        logits = logits + ref_xl(q, m.core.w_pos.view(D, 1, C).expand(D, E, C), pq, pk)  # shared
    logits = logits / math.sqrt(C)
    if causal:
        logits = logits.masked_fill(~(pk[:, None, :] <= pq[:, :, None])[:, None], float("-inf"))
    heads = torch.softmax(logits, -1) @ v[:, None]  # [B, E, T, C]
    return torch.einsum("bte,betc,ecd->btd", gates, heads, m.w_o)


def make(pos="xl", seed=0, router=True, **kw):
    torch.manual_seed(seed)
    kw.setdefault("k", K)
    m = MoAConfig(d_model=D, d_head=C, n_experts=E, pos=pos, n_layers=2, **kw).build().double()
    if router:  # the zero init would make every token pick the same (tied) experts
        with torch.no_grad():
            m.w_router.normal_()
    return m


@pytest.mark.parametrize("pos", ["xl", "rope", "none"])
@pytest.mark.parametrize("setting", ["self", "memory", "cross"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_matches_transcription(pos, setting, renormalize):
    m = make(pos, renormalize=renormalize)
    torch.manual_seed(1)
    x = torch.randn(2, 4, D, dtype=f64, requires_grad=True)
    kv, kw = None, {}
    if setting == "memory":
        kv = torch.cat([torch.randn(2, 3, D, dtype=f64), x], 1)
    elif setting == "cross":
        kv, kw = torch.randn(2, 6, D, dtype=f64, requires_grad=True), {"causal": False}
    y = m(x, kv, **kw)[0]
    ref = moa_reference(m, x, kv, **kw)
    torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-10)
    names, params = zip(*m.named_parameters())
    tensors = list(params) + [t for t in (x, kv) if t is not None and t.requires_grad]
    g = torch.randn_like(y)
    for name, a, b in zip(names + ("x", "kv"), torch.autograd.grad((y * g).sum(), tensors),
                          torch.autograd.grad((ref * g).sum(), tensors)):
        # The router's gradient passes through the float32 softmax.
        tol = dict(rtol=1e-7, atol=1e-9) if name in ("w_q", "w_k", "w_v", "w_o", "core.w_pos") \
            else dict(rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(a, b, **tol, msg=lambda s: f"{name}: {s}")


def test_expert_impls_agree():
    a, b = make("rope"), make("rope", expert_impl="reference", attn_impl="reference")
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, D, dtype=f64)
    torch.testing.assert_close(a(x)[0], b(x)[0], rtol=1e-12, atol=1e-12)


def test_counts_skip_invalid_queries_with_memory():
    # Causal attention over [memory ; x]: the last T entries of valid_k are the queries'.
    m = make("xl")
    x, mem = torch.randn(1, 4, D, dtype=f64), torch.randn(1, 3, D, dtype=f64)
    valid = torch.tensor([[True, True, True, True, False, True, False]])
    _, aux = m(x, torch.cat([mem, x], 1), valid_k=valid)
    assert aux.routing["router"].counts[0].sum().item() == 2 * K
    _, aux = m(x, torch.cat([mem, x], 1), valid_k=valid, causal=False)
    assert aux.routing["router"].counts[0].sum().item() == 4 * K


def test_aux_losses_by_hand():
    m = make("none", balance_coef=0.5, z_coef=0.25, cv_coef=2.0)
    torch.manual_seed(2)
    x = torch.randn(1, 6, D, dtype=f64)
    valid = torch.tensor([[True, True, False, True, True, False]])
    _, aux = m(x, valid_k=valid)
    logits = (x[0] @ m.w_router.t()).detach()[valid[0]]  # 4 real tokens
    p = torch.softmax(logits, -1)
    top = p.topk(K, -1).indices
    counts = torch.zeros(E, dtype=f64)
    gate_sum = torch.zeros(E, dtype=f64)
    for t in range(4):
        for e in top[t].tolist():
            counts[e] += 1
            gate_sum[e] += p[t, e]
    balance = E * ((p.sum(0) / p.sum()) * (counts / counts.sum())).sum()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    cv = gate_sum.var() / gate_sum.mean() ** 2
    assert aux.losses["balance"].item() == pytest.approx(0.5 * balance.item(), rel=1e-5)
    assert aux.losses["z"].item() == pytest.approx(0.25 * z.item(), rel=1e-5)
    assert aux.losses["cv"].item() == pytest.approx(2.0 * cv.item(), rel=1e-5)
    assert aux.routing["router"].counts[0].tolist() == counts.long().tolist()
    # The losses reach the router.
    sum(aux.losses.values()).backward()
    assert m.w_router.grad.abs().sum() > 0


def test_zero_coefficients_leave_no_losses():
    m = make("none", balance_coef=0.0, z_coef=0.0, cv_coef=0.0)
    _, aux = m(torch.randn(1, 3, D, dtype=f64))
    assert aux.losses == {}


def test_all_experts_with_uniform_gates():
    # k = E with the zero-initialised router: p = 1/E for every expert, so
    # y = (1/E) Σ_e softmax(q_e Kᵀ / sqrt(C)) V W_o^e; balance = E · Σ (1/E)(1/E) = 1,
    # z = log(E)², CV² = 0.
    m = make("none", router=False, k=E, cv_coef=1.0)
    assert torch.all(m.w_router == 0)
    torch.manual_seed(3)
    x = torch.randn(2, 5, D, dtype=f64)
    y, aux = m(x)
    k, v = x @ m.w_k, x @ m.w_v
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    expected = torch.zeros_like(y)
    for e in range(E):
        logits = (x @ m.w_q[e]) @ k.transpose(1, 2) / math.sqrt(C)
        att = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
        expected += (att @ v) @ m.w_o[e] / E
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-8)  # gates 1/E in float32
    assert aux.losses["balance"].item() == pytest.approx(0.01)
    assert aux.losses["z"].item() == pytest.approx(0.001 * math.log(E) ** 2, rel=1e-6)
    assert aux.losses["cv"].item() == pytest.approx(0.0, abs=1e-9)
    assert aux.routing["router"].counts[0].tolist() == [2 * 5] * E


@pytest.mark.parametrize("pos", ["xl", "rope", "none"])
def test_causality(pos):
    m = make(pos)
    x = torch.randn(1, 6, D, dtype=f64)
    x2 = x.clone()
    x2[:, 2:] = torch.randn(1, 4, D, dtype=f64)
    y, y2 = m(x)[0], m(x2)[0]
    assert torch.equal(y[:, :2], y2[:, :2]) and not torch.allclose(y[:, 2:], y2[:, 2:])


def test_usage_buffer_train_only():
    m = make("rope")
    x = torch.randn(2, 3, D, dtype=f64)
    m.eval()
    _, aux = m(x)
    assert torch.equal(m.usage, torch.zeros(E, dtype=torch.int64))
    m.train()
    m(x)
    assert torch.equal(m.usage, aux.routing["router"].counts[0]) and m.usage.sum().item() == 2 * 3 * K


@pytest.mark.parametrize("pos", ["xl", "rope", "none"])
def test_param_count(pos):
    cfg = MoAConfig(d_model=12, d_head=5, n_experts=6, k=3, pos=pos)
    m = cfg.build()
    assert m.param_count() == sum(p.numel() for p in m.parameters())
    assert cfg.n_heads == 3 and m.new_cache().length == 0 and isinstance(m, MoAAttention)


@pytest.mark.parametrize("kw,msg", [
    (dict(k=6), "k=6 exceeds n_experts=5"),
    (dict(k=0), "k must be a positive"),
    (dict(n_experts=0), "n_experts"),
    (dict(d_head=0), "d_head"),
    (dict(balance_coef=-1.0), "balance_coef"),
    (dict(pos="alibi"), "pos"),
])
def test_config_validation(kw, msg):
    base = dict(d_model=8, d_head=4, n_experts=5, k=2)
    with pytest.raises(ValueError, match=msg):
        MoAConfig(**{**base, **kw})


def test_runs_under_autocast():
    torch.manual_seed(4)
    m = MoAConfig(d_model=32, d_head=8, n_experts=4, k=2, pos="rope").build()
    with torch.no_grad():
        m.w_router.normal_()
    x = torch.randn(2, 16, 32)
    ref = m(x)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)[0]
    assert y.dtype == torch.bfloat16
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.05


def test_moa_with_its_zero_router_routes_every_token_to_the_first_experts():
    layer = MoAConfig(d_model=16, d_head=8, n_experts=6, k=3, n_layers=2).build()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    assert layer.inspect(x)["heads_BTK"].reshape(-1, 3).tolist() == [[0, 1, 2]] * 10
