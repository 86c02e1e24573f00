"""MoSA (arXiv 2505.00315, Sec. 2.2 and Eqs. 1-3) against an independent float64
transcription: one (sequence, head) at a time, r = σ(X W_r), I = the k highest scores (k = T // ρ
clamped to [2, T]; with include_first the first token and the k - 1 best others, Sec. 3.2),
attention among X[I] only with causality by original position (Eq. 1 with M_ij = 0 iff
I_i ≥ I_j), the output scaled by r[I], projected by W_O and put back at I, summed over heads
(Eq. 3); plus the dense heads of the hybrid written out as plain causal RoPE attention.

Decoding is prefix routing (moeify.layers.mosa): the cached output at t equals the full forward of
the prefix x_0..x_t at its last position.

Shape legend: B batch, T tokens, D d_model, H heads, C d_head.
"""

import math

import pytest
import torch

from moeify.layers.mosa import MoSAConfig
from references import ref_local_heads, ref_rope

f64 = torch.float64
D, H, C, RHO = 8, 3, 4, 3

pytestmark = pytest.mark.usefixtures("single_thread")


def make(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("pos", "rope")
    return MoSAConfig(d_model=D, n_heads=H, d_head=C, sparsity=RHO, n_layers=2, **kw).build(
    ).double()


def ref_attention(q, k, v, pos_q, pos_k):
    """softmax(q kᵀ / sqrt(C) + M) v with M_ij = 0 iff pos_k[j] <= pos_q[i]; q [Tq, C]."""
    logits = q @ k.t() / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~(pos_k[None, :] <= pos_q[:, None]), float("-inf"))
    return torch.softmax(logits, -1) @ v


def rot(x_NC, pos_N, on):
    return ref_rope(x_NC[None, None], pos_N[None], C // 2)[0, 0] if on else x_NC


def mosa_reference(m, x, valid=None):
    c = m.config
    B, T, _ = x.shape
    out = torch.zeros_like(x)
    rope = c.pos == "rope"
    for b in range(B):
        toks = [t for t in range(T) if valid is None or valid[b, t]]
        n = len(toks)
        kk = min(max(n // c.sparsity, 2), n)
        for h in range(c.n_heads):
            r = torch.sigmoid((x[b] @ m.w_router[h]).float())  # the sigmoid in float32
            order = sorted(toks, key=lambda t: (-(math.inf if c.include_first and t == 0
                                                   else float(r[t].detach())), t))
            I = torch.tensor(order[:kk])
            xs = x[b, I]
            q, k, v = xs @ m.w_q[h], xs @ m.w_k[h], xs @ m.w_v[h]
            q, k = rot(q, I, rope), rot(k, I, rope)
            a = ref_attention(q, k, v, I, I) * r[I].to(x.dtype)[:, None]
            out[b].index_add_(0, I, a @ m.w_o[h])
        if m.dense is not None:  # the hybrid's dense heads: plain causal attention over all
            w = m.dense
            Hd = c.n_dense_heads
            pos = torch.arange(T)
            keep = torch.tensor(toks)
            for h in range(Hd):
                sl = slice(h * C, (h + 1) * C)
                q = rot(x[b] @ w.w_q[:, sl], pos, rope)[keep]
                k = rot(x[b] @ w.w_k[:, sl], pos, rope)[keep]
                v = (x[b] @ w.w_v[:, sl])[keep]
                a = ref_attention(q, k, v, keep, keep)
                out[b].index_add_(0, keep, a @ w.w_o[sl])
    if m.local is not None:  # the long-sequence hybrid's local heads (Sec. 3.4)
        lo = m.local
        out = out + ref_local_heads(x, lo.w_q, lo.w_k, lo.w_v, lo.w_o, c.local_window, rope,
                                    valid)
    return out


def check(m, x, valid=None):
    y = m(x, valid_k=valid)[0]
    ref = mosa_reference(m, x, valid)
    if valid is not None:
        y, ref = y * valid[..., None], ref * valid[..., None]
    # r = σ(X W_r) is float32 (a router, as every router of the library) and multiplies the
    # output: the matmul's float32 summation order shows at float32 precision
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-7)
    params = list(m.parameters())
    g = torch.randn_like(y)
    ga = torch.autograd.grad((y * g).sum(), params + [x])
    gb = torch.autograd.grad((ref * g).sum(), params + [x])
    for (name, _), a, b in zip(list(m.named_parameters()) + [("x", None)], ga, gb):
        # the router's gradient passes through the float32 sigmoid: float32 accuracy there
        tol = (dict(rtol=1e-5, atol=1e-7) if name in ("w_router", "x")
               else dict(rtol=1e-7, atol=1e-9))
        torch.testing.assert_close(a, b, **tol, msg=lambda s: f"{name}: {s}")


def inputs(B=2, T=10, seed=1):
    torch.manual_seed(seed)
    return torch.randn(B, T, D, dtype=f64, requires_grad=True)


@pytest.mark.parametrize("pos", ["rope", "none"])
@pytest.mark.parametrize("n_dense", [0, 2])
def test_matches_the_transcription(pos, n_dense):
    check(make(pos=pos, n_dense_heads=n_dense), inputs())


def test_include_first_always_selects_the_first_token():
    m = make(include_first=True)
    check(m, inputs())
    idx, _ = m._select(m._scores(inputs().detach()), None)
    assert (idx == 0).any(-1).all()


def test_padding_routes_as_the_unpadded_sequence():
    m = make(n_dense_heads=1)
    x = inputs(B=2, T=10)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 7:] = False
    check(m, x, valid)
    alone = m(x[1:, :7].detach())[0]
    torch.testing.assert_close(m(x.detach(), valid_k=valid)[0][1:, :7], alone,
                               rtol=1e-12, atol=1e-12)


def test_only_k_tokens_per_head_and_the_rest_get_nothing_from_it():
    m = make()
    x = inputs(T=12).detach()
    idx, keep = m._select(m._scores(x), None)
    assert idx.shape[-1] == 12 // RHO and keep is None
    y = m(x)[0]
    chosen = torch.zeros(2, 12, dtype=torch.bool).scatter_(1, idx.flatten(1), True)
    assert torch.all(y[~chosen] == 0)  # a token no head picked gets no attention output
    stats = m(x)[1].stats
    assert stats["selected_fraction"] == 4 / 12
    assert stats["covered_fraction"] == chosen.float().mean()


@pytest.mark.parametrize("n_dense,include_first", [(0, False), (2, False), (1, True)])
def test_cached_decoding_is_the_full_forward_of_each_prefix(n_dense, include_first):
    m = make(n_dense_heads=n_dense, include_first=include_first).eval()
    x = inputs(B=2, T=9).detach()
    with torch.no_grad():
        cache = m.new_cache()
        parts = [m(x[:, :4], cache=cache)[0]] + [m(x[:, t:t + 1], cache=cache)[0]
                                                 for t in range(4, 9)]
        got = torch.cat(parts, 1)
        want = torch.stack([m(x[:, :t + 1])[0][:, t] for t in range(9)], 1)
    assert len(cache) == 9
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("pos,window,T", [("rope", 3, 10), ("none", 4, 8), ("rope", 16, 10)])
def test_local_hybrid_matches_the_transcription(pos, window, T):
    """Sec. 3.4's hybrid: MoSA heads plus local heads of window w (blocks of w, the current and
    the previous block), T a multiple of w or not, w longer than the sequence."""
    check(make(pos=pos, n_local_heads=2, local_window=window, n_dense_heads=1), inputs(T=T))


def test_local_hybrid_with_padding_and_decoding():
    m = make(n_local_heads=2, local_window=3)
    x = inputs(B=2, T=10)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 7:] = False
    lo = m.local  # the local heads alone, in float64 throughout (no float32 router)
    y = lo(x, torch.arange(10).expand(2, 10), valid) * valid[..., None]
    ref = ref_local_heads(x, lo.w_q, lo.w_k, lo.w_v, lo.w_o, 3, True, valid) * valid[..., None]
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    params = [x] + list(lo.parameters())
    for a, b in zip(torch.autograd.grad((y * g).sum(), params),
                    torch.autograd.grad((ref * g).sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    m.eval()
    x = x.detach()
    with torch.no_grad():
        cache = m.new_cache()
        got = torch.cat([m(x[:, :4], cache=cache)[0]] + [m(x[:, t:t + 1], cache=cache)[0]
                                                         for t in range(4, 9)], 1)
        want = torch.stack([m(x[:, :t + 1])[0][:, t] for t in range(9)], 1)
    # the MoSA heads' router score is float32 (r = σ(X W_r)): a float64 logit one ulp apart
    # between the one-token and the whole-prefix matmul can round to another float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_config_is_validated():
    with pytest.raises(ValueError, match="local_window"):
        MoSAConfig(d_model=D, n_heads=H, d_head=C, sparsity=RHO, n_local_heads=1)
    cfg = MoSAConfig(d_model=D, n_heads=H, d_head=C, sparsity=RHO, n_local_heads=2,
                     local_window=4)
    assert cfg.param_count() == sum(p.numel() for p in cfg.build().parameters())
    with pytest.raises(ValueError, match="pos"):
        MoSAConfig(d_model=D, n_heads=H, d_head=C, sparsity=RHO, pos="xl")
    with pytest.raises(ValueError, match="self-attention"):
        make()(inputs().detach(), inputs().detach())
    cfg = MoSAConfig(d_model=D, n_heads=H, d_head=C, sparsity=RHO, n_dense_heads=2)
    assert cfg.param_count() == sum(p.numel() for p in cfg.build().parameters())


def test_local_hybrid_compiles_as_one_graph_equal_to_eager():
    torch._dynamo.reset()
    m = make(n_local_heads=2, local_window=3)
    x = inputs(T=10)
    y = m(x)[0]
    yc = torch.compile(lambda t: m(t)[0], fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(yc, y, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    params = [x] + list(m.local.parameters())
    for a, b in zip(torch.autograd.grad(yc, params, g), torch.autograd.grad(y, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
