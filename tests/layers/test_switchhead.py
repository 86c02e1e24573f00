"""SwitchHead against an independent transcription of the paper's Eq. 7-10 (arXiv 2312.07987):
every expert matrix applied densely to every token, the top-k choice expressed as a 0/1 mask over
the E experts of each head. Attention is written out here as well; RoPE, XL and the default
positions come from references.py.

Shape legend: B batch, T destination tokens, S source tokens, D d_model, H heads, E experts per
head, K kept experts, C d_head.
"""

import dataclasses
import itertools
import math

import pytest
import torch

from moeify.layers.switchhead import SwitchHeadAttention, SwitchHeadConfig
from references import ref_positions, ref_rope, ref_xl

f64 = torch.float64
D, H, C, E, K = 10, 2, 4, 4, 2


pytestmark = pytest.mark.usefixtures("single_thread")


# Table 6 of the paper: every non-empty subset of {Q, K, V, O}.
TABLE6 = [frozenset(s) for n in range(1, 5) for s in itertools.combinations("qkvo", n)]


# ---------------------------------------------------------------------------- transcription


def topk_gates(x_BND, w_XD):
    """Eq. 7-8: s = sigmoid(x W_S) in float32, [B, N, H, E]; zero outside each head's top-k."""
    s = torch.sigmoid((x_BND @ w_XD.t()).float()).view(*x_BND.shape[:2], H, E)
    keep = torch.zeros_like(s).scatter(-1, s.detach().topk(K, -1).indices, 1.0)
    return (s * keep).to(x_BND.dtype)


def switchhead_reference(m, xq, xkv=None, *, causal=True, pos_q=None, pos_k=None):
    c = m.config
    xs = xq if xkv is None else xkv
    B, T, S = xq.shape[0], xq.shape[1], xs.shape[1]
    ex = c.experts
    w_src = m.w_router if c.shared_selection else getattr(m, "w_router_src", None)
    w_dst = m.w_router if c.shared_selection else getattr(m, "w_router_dst", None)
    g_src = topk_gates(xs, w_src) if ex & {"k", "v"} else None  # V selection: source tokens
    g_dst = topk_gates(xq, w_dst) if ex & {"q", "o"} else None  # O selection: destination

    def proj(name, x, g):  # Eq. 9 for expert projections, a plain per-head projection otherwise
        w = getattr(m, f"w_{name}")
        if name in ex:
            return torch.einsum("bnhe,bnd,hedc->bhnc", g, x, w.view(H, E, D, C))
        return torch.einsum("bnd,dhc->bhnc", x, w.view(D, H, C))

    q, k, v = proj("q", xq, g_dst), proj("k", xs, g_src), proj("v", xs, g_src)
    pq, pk = ref_positions(B, T, S, pos_q, pos_k)
    if c.pos == "rope":
        q, k = ref_rope(q, pq, C // 2), ref_rope(k, pk, C // 2)
    logits = torch.einsum("bhtc,bhsc->bhts", q, k)
    if c.pos == "xl":  # no u/v biases in SwitchHead-XL, fixed scale
        logits = logits + ref_xl(q, m.core.w_pos.view(D, H, C), pq, pk)
    logits = logits / math.sqrt(C)
    if causal:
        logits = logits.masked_fill(~(pk[:, None, :] <= pq[:, :, None])[:, None], float("-inf"))
    o = torch.softmax(logits, -1) @ v  # A_h V_h
    if "o" in ex:  # Eq. 10: gated expert outputs, summed over heads
        return torch.einsum("bthe,bhtc,hecd->btd", g_dst, o, m.w_o.view(H, E, C, D))
    return torch.einsum("bhtc,hcd->btd", o, m.w_o.view(H, C, D))


def make(pos="xl", seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("experts", frozenset({"v", "o"}))
    cfg = SwitchHeadConfig(d_model=D, n_heads=H, d_head=C, n_experts=E, k=K, pos=pos,
                           n_layers=2, **kw)
    return cfg.build().double()


def check_against_reference(m, xq, xkv=None, **kw):
    params = dict(m.named_parameters())
    inputs = [t for t in (xq, xkv) if t is not None and t.requires_grad]
    y = m(xq, xkv, **kw)[0]
    ref = switchhead_reference(m, xq, xkv, **kw)
    torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-10)
    g = torch.randn_like(y)
    tensors = list(params.values()) + inputs
    ga = torch.autograd.grad((y * g).sum(), tensors)
    gb = torch.autograd.grad((ref * g).sum(), tensors)
    names = list(params) + [f"input{i}" for i in range(len(inputs))]
    for name, a, b in zip(names, ga, gb):
        # Selection gradients pass through the float32 sigmoid: float32 accuracy there (an
        # absolute 2e-7: two float32 ulps of the O(1) gradients).
        tol = dict(rtol=1e-5, atol=2e-7) if name.startswith(("w_router", "input")) \
            else dict(rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(a, b, **tol, msg=lambda s: f"{name}: {s}")


def inputs(setting, seed=1):
    torch.manual_seed(seed)
    B, T = 2, 4
    x = torch.randn(B, T, D, dtype=f64, requires_grad=True)
    if setting == "self":
        return x, None, {}
    if setting == "memory":  # [memory ; x], memory detached as in XL training
        return x, torch.cat([torch.randn(B, 3, D, dtype=f64), x], 1), {}
    if setting == "cross":  # different lengths, no causal mask
        return x, torch.randn(B, 6, D, dtype=f64, requires_grad=True), {"causal": False}
    raise AssertionError(setting)


# ---------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("experts", TABLE6, ids=lambda s: "".join(sorted(s)))
@pytest.mark.parametrize("pos,setting", [("rope", "self"), ("xl", "memory")])
def test_every_table6_subset_matches_eq_7_10(experts, pos, setting):
    m = make(pos, experts=experts)
    x, kv, kw = inputs(setting)
    check_against_reference(m, x, kv, **kw)


SHARED = [s for s in TABLE6 if s & {"k", "v"} and s & {"q", "o"}]


@pytest.mark.parametrize("experts", SHARED, ids=lambda s: "".join(sorted(s)))
@pytest.mark.parametrize("pos,setting", [("rope", "self"), ("xl", "memory")])
def test_shared_selection_matches_eq_7_10(experts, pos, setting):
    m = make(pos, experts=experts, shared_selection=True)
    assert not hasattr(m, "w_router_src") and not hasattr(m, "w_router_dst")
    x, kv, kw = inputs(setting)
    check_against_reference(m, x, kv, **kw)


@pytest.mark.parametrize("pos", ["xl", "rope", "none"])
@pytest.mark.parametrize("setting", ["self", "memory", "cross"])
def test_default_layer_all_settings(pos, setting):
    m = make(pos)
    x, kv, kw = inputs(setting)
    check_against_reference(m, x, kv, **kw)


def test_explicit_positions_match_eq_7_10():
    for pos in ("xl", "rope"):
        m = make(pos, experts=frozenset("qkvo"))
        x, _, _ = inputs("self")
        p = torch.tensor([[1, 4, 5, 9], [0, 3, 7, 8]])
        check_against_reference(m, x, pos_q=p, pos_k=p)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("experts,shared", [("vo", False), ("vo", True), ("ko", False),
                                            ("qv", False), ("v", False), ("o", False)])
@pytest.mark.parametrize("setting", ["self", "memory", "cross"])
def test_fused_and_separate_selection_logits_match_eq_7_10(fuse, experts, shared, setting):
    # Dense Q / K may share one matmul with the selection logits of their input (the default
    # outside autocast); both ways must give the paper's layer, outputs and every gradient.
    m = make("xl", experts=frozenset(experts), shared_selection=shared)
    m.fuse_selection = fuse
    x, kv, kw = inputs(setting)
    check_against_reference(m, x, kv, **kw)


@pytest.mark.parametrize("impl", ["reference", "gather", "segment", "padded", "sets", "concat"])
def test_expert_impls_agree(impl):
    fast, slow = make("xl", experts=frozenset("qkvo")), make("xl", experts=frozenset("qkvo"),
                                                          expert_impl=impl, attn_impl="reference")
    slow.load_state_dict(fast.state_dict())
    x, kv, _ = inputs("memory")
    ya, yb = fast(x, kv)[0], slow(x, kv)[0]
    torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-12)
    ga = torch.autograd.grad(ya.square().sum(), list(fast.parameters()))
    gb = torch.autograd.grad(yb.square().sum(), list(slow.parameters()))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("experts", TABLE6, ids=lambda s: "".join(sorted(s)))
@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_decoding_with_every_expert_in_the_fused_matmul_matches_eq_7_10(experts, pos,
                                                                        monkeypatch):
    # Decoding a few rows without gradients: the Q / K / V experts join the fused projection
    # matmul for every expert ("name@all") and are gate-weighted per head afterwards, the O
    # experts run as one GEMM over every expert; no expert_matmul call is left. Token by token
    # through the cache it must be the unfused layer, and the paper's over the whole sequence.
    m = make(pos, experts=experts)
    unfused = make(pos, experts=experts, expert_impl="reference")
    unfused.load_state_dict(m.state_dict())
    torch.manual_seed(3)
    B, T = 3, 5  # 3 rows x 2 heads x k=2 = 12 pairs > 8 experts: "auto" takes "all"
    x = torch.randn(B, T, D, dtype=f64)

    def decode(layer):
        cache = layer.new_cache()
        with torch.no_grad():
            return torch.cat([layer(x[:, t:t + 1], cache=cache)[0] for t in range(T)], 1)

    want = decode(unfused)

    def unexpected(*args, **kwargs):
        raise AssertionError("decoding called expert_matmul")

    monkeypatch.setattr("moeify.layers.switchhead.expert_matmul", unexpected)
    y = decode(m)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-13)
    # Against the full-sequence transcription, a float32 gate may round differently (the
    # tolerance of tests/layers/test_kv_cache.py).
    torch.testing.assert_close(y, switchhead_reference(m, x), rtol=1e-5, atol=1e-6)
    folded = {key for keys in m._weight_memo for key in keys if key.endswith("@all")}
    assert folded == {f"{n}@all" for n in experts & {"q", "k", "v"}}


def test_expert_projections_stay_out_of_the_fused_matmul_with_gradients_or_many_rows():
    m = make("xl", experts=frozenset("qkvo"))
    x = torch.randn(3, 1, D, dtype=f64)
    assert not any(n.endswith("@all") for n in m._fused_projections(x, None)[0])  # gradients
    with torch.no_grad():
        assert {n for n in m._fused_projections(x, None)[0] if n.endswith("@all")} == \
            {"q@all", "k@all", "v@all"}
        many = torch.randn(4, 16, D, dtype=f64)  # 64 rows: a sorted layout, not "all"
        assert not any(n.endswith("@all") for n in m._fused_projections(many, None)[0])
        m.config = dataclasses.replace(m.config, expert_impl="gather")
        assert not any(n.endswith("@all") for n in m._fused_projections(x, None)[0])


# ---------------------------------------------------------------------------- behaviour


def test_selection_sides_in_cross_attention():
    m = make("rope", experts=frozenset("qkvo"))
    torch.manual_seed(5)
    q, kv = torch.randn(2, 3, D, dtype=f64), torch.randn(2, 7, D, dtype=f64)
    base = m.select(q, kv)
    assert base["dst"].idx.shape == (2 * 3, H, K) and base["src"].idx.shape == (2 * 7, H, K)
    moved_q = m.select(q + torch.randn_like(q), kv)
    assert torch.equal(moved_q["src"].gates, base["src"].gates)
    assert not torch.equal(moved_q["dst"].gates, base["dst"].gates)
    moved_kv = m.select(q, kv + torch.randn_like(kv))
    assert torch.equal(moved_kv["dst"].gates, base["dst"].gates)
    assert not torch.equal(moved_kv["src"].gates, base["src"].gates)
    # The forward pass routes with exactly these selections.
    ids_o = torch.zeros(6, H, E).scatter(-1, base["dst"].idx, 1.0).view(2, 3, H, E).sum((0, 1))
    y, aux = m(q, kv, causal=False)
    assert torch.equal(aux.routing["dst"].counts, ids_o.long())
    assert aux.routing["src"].counts.sum().item() == 2 * 7 * H * K


@pytest.mark.parametrize("pos", ["xl", "rope", "none"])
def test_causality(pos):
    m = make(pos, experts=frozenset("qkvo"))
    torch.manual_seed(6)
    x = torch.randn(2, 6, D, dtype=f64)
    x2 = x.clone()
    x2[:, 3:] = torch.randn(2, 3, D, dtype=f64)
    y, y2 = m(x)[0], m(x2)[0]
    assert torch.equal(y[:, :3], y2[:, :3])
    assert not torch.allclose(y[:, 3:], y2[:, 3:])


def test_single_token_gradient_is_sparse():
    m = make("xl", seed=7)
    x = torch.randn(1, 1, D, dtype=f64)
    m(x)[0].square().sum().backward()
    for name, shape in (("w_v", (H, E, D, C)), ("w_o", (H, E, C, D))):
        g = getattr(m, name).grad.view(shape)
        touched = g.flatten(2).abs().sum(-1) > 0  # [H, E]
        assert touched.sum(-1).tolist() == [K] * H, name


def test_usage_buffers_train_only_and_counts():
    m = make("rope", experts=frozenset({"v", "o"}))
    x, kv, kw = inputs("memory")
    m.eval()
    m(x, kv)
    assert torch.equal(m.usage_v, torch.zeros(H, E, dtype=torch.int64))
    assert torch.equal(m.usage_o, torch.zeros(H, E, dtype=torch.int64))
    m.train()
    _, aux = m(x, kv)
    # Hand counts: how often each expert is among the top-k, per head and side.
    count_v = (topk_gates(kv, m.w_router_src) > 0).sum((0, 1))
    count_o = (topk_gates(x, m.w_router_dst) > 0).sum((0, 1))
    assert torch.equal(aux.routing["src"].counts, count_v) and torch.equal(m.usage_v, count_v)
    assert torch.equal(aux.routing["dst"].counts, count_o) and torch.equal(m.usage_o, count_o)
    m(x, kv)
    assert torch.equal(m.usage_v, 2 * count_v)


def test_counts_skip_invalid_tokens():
    m = make("rope")
    x = torch.randn(1, 4, D, dtype=f64)
    valid = torch.tensor([[True, False, True, False]])
    _, aux = m(x, valid_k=valid)
    assert aux.routing["src"].counts.sum().item() == 2 * H * K
    assert aux.routing["dst"].counts.sum().item() == 2 * H * K


def test_counts_skip_invalid_queries_with_memory():
    # Causal attention over [memory ; x]: the queries are the last T keys, so their validity is
    # the last T entries of valid_k; in cross-attention it is unknown and every query counts.
    m = make("xl")
    x, mem = torch.randn(1, 4, D, dtype=f64), torch.randn(1, 3, D, dtype=f64)
    valid = torch.tensor([[True, True, True, True, False, True, False]])
    _, aux = m(x, torch.cat([mem, x], 1), valid_k=valid)
    assert aux.routing["src"].counts.sum().item() == 5 * H * K
    assert aux.routing["dst"].counts.sum().item() == 2 * H * K
    _, aux = m(x, torch.cat([mem, x], 1), valid_k=valid, causal=False)
    assert aux.routing["dst"].counts.sum().item() == 4 * H * K


def test_gates_are_raw_sigmoids_in_float32():
    m = make("rope")
    sel = m.select(torch.randn(1, 3, D, dtype=f64))["src"]
    assert sel.gates.dtype == torch.float32
    assert (sel.gates > 0).all() and (sel.gates < 1).all()
    assert not torch.allclose(sel.gates.sum(-1), torch.ones(3, H))  # not renormalised


# ---------------------------------------------------------------------------- sizes and init


@pytest.mark.parametrize("experts", TABLE6, ids=lambda s: "".join(sorted(s)))
@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_param_count_formula(experts, pos):
    for shared in (False, True):
        if shared and experts not in SHARED:
            continue
        cfg = SwitchHeadConfig(d_model=12, n_heads=3, d_head=5, n_experts=4, k=2, pos=pos,
                               experts=experts, shared_selection=shared)
        assert cfg.build().param_count() == sum(p.numel() for p in cfg.build().parameters())


def test_paper_47m_layer_params():
    # WT103 47M SwitchHead (SwitchHead Table 9): the authors' model total 47,247,416 minus embedding
    # (8000·412), output (412·8000 + 8000), final LN (824) and 16 x (FFN 412·2080·2 + 2080 + 412
    # and two LNs 1648) leaves 16 x 822,352 for attention.
    cfg = SwitchHeadConfig(d_model=412, n_heads=2, d_head=76, n_experts=5, k=2, pos="xl",
                           n_layers=16)
    ffn, lns = 412 * 2080 * 2 + 2080 + 412, 4 * 412
    rest = 8000 * 412 + 412 * 8000 + 8000 + 824 + 16 * (ffn + lns)
    assert 16 * cfg.param_count() + rest == 47_247_416


def test_init_follows_spec():
    L = 8
    cfg = SwitchHeadConfig(d_model=256, n_heads=2, d_head=64, n_experts=8, k=2, pos="xl",
                           n_layers=L)
    m = cfg.build()
    s = math.sqrt(2 / L)
    assert m.w_v.std().item() == pytest.approx(s / 16, rel=0.02)
    assert m.w_o.std().item() == pytest.approx(s / math.sqrt(128), rel=0.02)
    assert m.core.w_pos.std().item() == pytest.approx(s / 16, rel=0.03)
    for w in (m.w_router_src, m.w_router_dst):
        # The authors' rule: row norms follow the rows' own spreads, not one common norm
        # (sigma-MoE's rule, which equalises them).
        norms = w.norm(dim=-1)
        assert (norms.max() / norms.min()).item() > 1.01
        assert w.std().item() == pytest.approx(s / 16, rel=0.08)


def test_selection_init_is_the_authors_rule_in_float64():
    from references import ref_switchhead_selection_init

    from moeify.layers.common import renorm_rows_keep_row_std_

    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=g, dtype=torch.float64) * 0.05
    ref = ref_switchhead_selection_init(w.clone())
    got = renorm_rows_keep_row_std_(w.clone())
    torch.testing.assert_close(got, ref, rtol=1e-13, atol=1e-15)
    # each row's norm is its own std over the unit rows' std: the spread survives
    ratio = got.norm(dim=-1) / w.std(dim=-1)
    torch.testing.assert_close(ratio, ratio.mean().expand_as(ratio), rtol=1e-13, atol=0)


@pytest.mark.parametrize("kw,msg", [
    (dict(k=5), "k=5 exceeds n_experts=4"),
    (dict(k=0), "k must be a positive"),
    (dict(n_experts=0), "n_experts"),
    (dict(d_head=0), "d_head"),
    (dict(d_model=-3), "d_model"),
    (dict(experts={"v", "x"}), "unknown expert"),
    (dict(experts=set()), "empty"),
    (dict(experts="vo"), "collection"),
    (dict(experts={"v"}, shared_selection=True), "both sides"),
    (dict(pos="alibi"), "pos"),
    (dict(expert_impl="cvmm"), "expert_impl"),  # not a name ("triton" is one now)
])
def test_config_validation(kw, msg):
    base = dict(d_model=8, n_heads=2, d_head=4, n_experts=4, k=2)
    with pytest.raises(ValueError, match=msg):
        SwitchHeadConfig(**{**base, **kw})


def test_config_normalises_experts_and_builds():
    SwitchHeadConfig(d_model=8, n_heads=2, d_head=4, n_experts=4, k=2, expert_impl="sets")
    cfg = SwitchHeadConfig(d_model=8, n_heads=2, d_head=4, n_experts=4, k=2, experts=["o", "v"])
    assert cfg.experts == frozenset({"v", "o"}) and cfg.n_selections == 2
    assert isinstance(cfg.build(), SwitchHeadAttention)
    assert cfg.build().new_cache().length == 0


def test_runs_under_autocast():
    # Mixed precision (the SwitchHead appendix trains under autocast): expert matmuls take the
    # autocast dtype.
    torch.manual_seed(8)
    m = SwitchHeadConfig(d_model=32, n_heads=2, d_head=8, n_experts=4, k=2, pos="xl",
                         experts=frozenset("qkvo")).build()
    x = torch.randn(2, 16, 32)
    ref = m(x)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)[0]
    assert y.dtype == torch.bfloat16
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.05
    y.float().square().sum().backward()
    assert m.w_v.grad is not None and m.w_o.grad is not None


def test_selection_scores_stay_float32_under_autocast():
    # SwitchHead Eq. 7-10: selection scores are computed in float32; bf16 autocast must not round
    # them.
    from moeify.layers.switchhead import SwitchHeadConfig

    torch.manual_seed(0)
    att = SwitchHeadConfig(d_model=32, n_heads=2, d_head=8, n_experts=4, k=2, pos="rope").build()
    x = torch.randn(2, 16, 32)
    want = torch.sigmoid(x.reshape(-1, 32).double() @ att.w_router_src.detach().double().t())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sel = att.select(x)["src"]
    ref = want.view(32, 2, 4).gather(-1, sel.idx.view(32, 2, 2))
    assert sel.gates.dtype == torch.float32
    assert (sel.gates.view(32, 2, 2).double() - ref).abs().max() < 1e-5


def test_moeut_entropy_regulariser_on_one_application():
    # MoEUT's attention regulariser (entropy_coef = delta) on a layer used once: per selection,
    # minus the entropy of each sequence's mean selection softmax, averaged over sequences and
    # heads, times delta; written out here from the selection logits x W_Sᵀ.
    delta = 0.001
    m = make(pos="rope", entropy_coef=delta)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    _, aux = m(x)
    assert aux.losses == {} and set(aux.pooled) == {"entropy.src", "entropy.dst"}
    want = 0.0
    for side in ("src", "dst"):
        p = torch.softmax((x @ getattr(m, f"w_router_{side}").t()).view(2, 5, H, E), -1).mean(1)
        want = want + delta * (p * p.log()).sum(-1).mean()
    torch.testing.assert_close(aux.total_loss(), want, rtol=1e-10, atol=0)
    # off by default (the SwitchHead paper has none); one term for a shared selection
    assert not make(pos="rope")(x)[1].pooled
    shared = make(pos="rope", entropy_coef=delta, shared_selection=True)
    assert set(shared(x)[1].pooled) == {"entropy.src"}
