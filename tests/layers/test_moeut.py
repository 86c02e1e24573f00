"""MoEUT (arXiv 2405.16039) against an independent float64 transcription of the whole shared-layer
model: embedding, L = R·G layer applications where application i uses the parameters of block
i mod G (layer grouping), each a peri-layernorm block:

    h = LN1(x);  x = x + SwitchHead(q = h, k = h, selections on h, v = x)     (SwitchHead Eq. 7-10)
    x = x + sigmaMoE(experts on x, selection on LN2(x))
    logits = Out(LN_f(x))

LayerNorm, RoPE, the top-k sigmoid gates and the expert MLP are written out here (RoPE and the
expert MLP from tests/references.py), never taken from moeify.

Shape legend: B batch, T tokens, D d_model, H heads, E experts per head, K kept experts,
C d_head.
"""

import dataclasses
import math

import pytest
import torch

from moeify.models.config import ModelConfig
from moeify.models.moeut_presets import moeut_lm
from references import ref_expert_mlp, ref_rope

f64 = torch.float64
V, D, L, G, H, C, E_ATT, E_FF, K_FF, N_FF = 11, 8, 4, 2, 2, 4, 3, 4, 2, 5

pytestmark = pytest.mark.usefixtures("single_thread")


def make(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = moeut_lm(vocab=V, d=D, L=L, G=G, H=H, d_h=C, att_E=E_ATT, ff_E=E_FF, ff_k=K_FF,
                   expert_size=N_FF, T=16, **kw)
    m = cfg.build().double()
    with torch.no_grad():  # non-trivial norm parameters, so that a dropped norm shows
        for name, p in m.named_parameters():
            if ".ln" in name or name.startswith("ln_f") or name.startswith("output.bias"):
                p.add_(0.3 * torch.randn_like(p))
    return m


def ref_ln(x, ln):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * ln.weight + ln.bias


def ref_gates(x_BTD, w_XD, n_heads, n_exp, k):
    """sigmoid(x W_Sᵀ) in float32 (SwitchHead Eq. 7-8 / sigma-MoE), zero outside the top-k."""
    s = torch.sigmoid((x_BTD @ w_XD.t()).float()).view(*x_BTD.shape[:2], n_heads, n_exp)
    keep = torch.zeros_like(s).scatter(-1, s.detach().topk(k, -1).indices, 1.0)
    return (s * keep).to(x_BTD.dtype)


def ref_switchhead(att, h, x):
    """Eq. 7-10 with V and O experts; Q, K and both selections from h, V from x; RoPE on half
    of each head's channels (n_rot = C/2), causal."""
    B, T, _ = h.shape
    g_src = ref_gates(h, att.w_router_src, H, E_ATT, 2)
    g_dst = ref_gates(h, att.w_router_dst, H, E_ATT, 2)
    q = torch.einsum("btd,dhc->bhtc", h, att.w_q.view(D, H, C))
    k = torch.einsum("btd,dhc->bhtc", h, att.w_k.view(D, H, C))
    v = torch.einsum("bthe,btd,hedc->bhtc", g_src, x, att.w_v.view(H, E_ATT, D, C))
    pos = torch.arange(T).expand(B, T)
    q, k = ref_rope(q, pos, C // 2), ref_rope(k, pos, C // 2)
    logits = q @ k.transpose(-1, -2) / math.sqrt(C)
    logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.softmax(logits, -1) @ v
    return torch.einsum("bthe,bhtc,hecd->btd", g_dst, o, att.w_o.view(H, E_ATT, C, D))


def ref_sigma_moe(ff, x, r):
    """Experts on x, the selection on r = LN2(x): Σ_k g_k · relu(x W1[e_k]) W2[e_k]. The
    sigma-MoE router works in float32 from its inputs on (arXiv 2310.10837)."""
    B, T, _ = x.shape
    s = torch.sigmoid(r.float() @ ff.w_router.float().t()).reshape(B * T, E_FF)
    g, idx = s.topk(K_FF, -1)
    y = ref_expert_mlp(x.reshape(B * T, D), idx, ff.experts.w_in, ff.experts.w_out, g.to(x.dtype))
    return y.view(B, T, D)


def moeut_reference(m, ids, record=None):
    """The logits; with ``record`` (a dict) also every application's selection logits, by
    (block, "v" / "o" / "ff"): V's and O's [B, T, H, E] (float64, from LN1(x)), the
    sigma-MoE's [B, T, E] (float32 as its router, from LN2(x))."""
    x = m.embedding.weight[ids]
    for i in range(L):  # layer grouping: application i runs block i mod G
        blk = m.blocks[i % G]
        h = ref_ln(x, blk.ln1)
        if record is not None:
            att = blk.attention
            for name, w in (("v", att.w_router_src), ("o", att.w_router_dst)):
                record.setdefault((i % G, name), []).append(
                    (h @ w.t()).view(*h.shape[:2], H, E_ATT))
        x = x + ref_switchhead(blk.attention, h, x)
        r = ref_ln(x, blk.ln2)
        if record is not None:
            record.setdefault((i % G, "ff"), []).append(
                r.float() @ blk.feedforward.w_router.float().t())
        x = x + ref_sigma_moe(blk.feedforward, x, r)
    return ref_ln(x, m.ln_f) @ m.output.weight.t() + m.output.bias


def ids_BT(B=2, T=7, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_shared_peri_layernorm_model_matches_the_transcription():
    m = make()
    assert len(m.blocks) == G
    ids = ids_BT()
    y, ref = m(ids).logits, moeut_reference(m, ids)
    torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-10)
    params = list(m.parameters())
    g = torch.randn_like(y)
    ga = torch.autograd.grad((y * g).sum(), params)
    gb = torch.autograd.grad((ref * g).sum(), params)
    for (name, _), a, b in zip(m.named_parameters(), ga, gb):
        # Selection gradients pass through the float32 sigmoid: float32 accuracy there.
        tol = (dict(rtol=1e-5, atol=1e-7) if "sel" in name
               else dict(rtol=1e-6, atol=1e-8))
        torch.testing.assert_close(a, b, **tol, msg=lambda s: f"{name}: {s}")


def test_every_shared_block_gets_the_gradient_of_all_its_applications():
    # Weight sharing: block 0 runs at layers 0 and 2; its gradient is the sum over both.
    m = make()
    ids = ids_BT()
    m(ids).logits.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for n, p in m.named_parameters() if n.startswith("blocks.")
               and "ln" not in n)
    with torch.no_grad():  # perturbing block 1 changes the layer-1 and layer-3 applications
        before = m(ids).logits
        m.blocks[1].feedforward.experts.w_out.mul_(2.0)
        assert not torch.allclose(before, m(ids).logits)


def test_kv_cache_decoding_equals_the_full_forward():
    m = make().eval()
    ids = ids_BT(T=9)
    with torch.no_grad():
        full = m(ids).logits
        cache = m.new_cache()
        assert len(cache) == L  # one cache per application, not per shared block
        parts = [m(ids[:, :3], cache=cache).logits]
        parts += [m(ids[:, t:t + 1], cache=cache).logits for t in range(3, 9)]
    # a float32 gate may round differently token by token (tests/layers/test_kv_cache.py)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-6)


def test_initialisation_uses_the_depth_of_all_applications():
    # the authors' reset_parameters: s = sqrt(2 / (n_repeats · G)) = sqrt(2 / L).
    torch.manual_seed(0)
    cfg = moeut_lm(vocab=V, d=256, L=8, G=2, H=2, d_h=64, att_E=4, ff_E=8, ff_k=2,
                   expert_size=64, T=16)
    m = cfg.build()
    s = math.sqrt(2 / 8)
    att, ff = m.blocks[0].attention, m.blocks[0].feedforward
    for w, std in ((att.w_q, s / 16), (att.w_v, s / 16), (att.w_o, s / math.sqrt(128)),
                   (ff.experts.w_in, s / 16), (ff.experts.w_out, s / math.sqrt(8 * 64))):
        assert abs(w.std().item() / std - 1) < 0.05


def test_peri_ln_and_grouping_are_validated():
    cfg = moeut_lm(vocab=V, d=D, L=L, G=G, H=H, d_h=C, att_E=E_ATT, ff_E=E_FF, ff_k=K_FF,
                   expert_size=N_FF, T=16)
    with pytest.raises(ValueError, match="divisor of n_layers"):
        dataclasses.replace(cfg, group_size=3)
    with pytest.raises(ValueError, match="XL memory"):
        dataclasses.replace(cfg, xl_memory=True)
    from moeify.layers.attention import DenseAttentionConfig
    with pytest.raises(ValueError, match="SwitchHeadConfig"):
        dataclasses.replace(cfg, attention=DenseAttentionConfig(d_model=D, n_heads=2, d_head=4,
                                                                pos="rope", n_layers=L))
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    # The JSON of a model without the MoEUT options reads as before they existed.
    plain = dataclasses.replace(cfg, group_size=0, block="pre_ln")
    assert "group_size" not in plain.to_dict() and "block" not in plain.to_dict()


def test_attention_maps_of_a_shared_block():
    from moeify.analysis.attention_maps import compute_attention_maps

    m = make().float()
    maps = compute_attention_maps(m, list(range(6)), layer=1)
    assert maps is not None


# ---- the regularisers (the authors' MoEUT: RobertCsordas/moeut, moeut.py) -------------------

GAMMA, DELTA = 0.01, 0.001  # the authors' entropy_reg and att_entropy_reg defaults


def ref_entropy_reg(logits, valid_BT=None):
    """The authors' ``entropy_reg(sel, dim)`` applied as their get_reg_loss does: the selection
    logits of every application of one shared layer (a list of [B, T, *X, E]) joined along
    time, log_softmax over experts, log-mean over (applications x tokens) per sequence, minus
    the entropy averaged over sequences (and heads X). Padding (valid_BT False) takes no part."""
    sel = torch.log_softmax(torch.cat(logits, 1), -1)  # [B, n·T, *X, E]
    n = torch.full((sel.shape[0],), float(sel.shape[1]), dtype=sel.dtype)
    if valid_BT is not None:
        keep = torch.cat([valid_BT] * len(logits), 1)
        sel = sel.masked_fill(~keep.view(*keep.shape, *[1] * (sel.dim() - 2)), float("-inf"))
        n = keep.sum(1).to(sel.dtype)
    lm = torch.logsumexp(sel, 1) - torch.log(n).view(-1, *[1] * (sel.dim() - 2))
    entropy = -(lm * lm.exp()).sum(-1)
    return -entropy.mean()


def ref_regularisers(record, valid_BT=None, pool=ref_entropy_reg):
    """By block g: gamma · reg(sigma-MoE selection), delta · reg(V selection), delta ·
    reg(O selection), each over all of block g's applications."""
    out = {}
    for g in range(G):
        out[f"layers.{g}.ff.entropy"] = GAMMA * pool(record[(g, "ff")], valid_BT)
        out[f"layers.{g}.attn.entropy.src"] = DELTA * pool(record[(g, "v")], valid_BT)
        out[f"layers.{g}.attn.entropy.dst"] = DELTA * pool(record[(g, "o")], valid_BT)
    return out


def per_application(logits, valid_BT=None):
    """The alternative the authors do not use: the entropy taken per application, summed."""
    return sum(ref_entropy_reg([l], valid_BT) for l in logits)


def batch_pooled(logits, valid_BT=None):
    """Another alternative: pooled over the whole batch's tokens (the sigma-MoE paper's form)."""
    flat = [l.reshape(1, -1, *l.shape[2:]) for l in logits]
    return ref_entropy_reg(flat, None if valid_BT is None else valid_BT.reshape(1, -1))


@pytest.mark.parametrize("padded", [False, True])
def test_regularisers_are_the_authors_pooled_over_a_shared_blocks_applications(padded):
    m = make()
    ids = ids_BT(B=3, T=7)
    valid = None
    if padded:  # right padding: causal attention keeps the real tokens' states as without it
        valid = torch.ones(3, 7, dtype=torch.bool)
        valid[1, 5:] = False
        valid[2, 3:] = False
    out = m(ids, valid_BT=valid)
    record = {}
    moeut_reference(m, ids, record)
    ref = ref_regularisers(record, valid)
    assert set(out.losses) == set(ref)  # one term per shared block, not per application
    for key, want in ref.items():
        # the sigma-MoE router (and so its term) is float32; the attention's are float64
        tol = dict(rtol=1e-5, atol=1e-9) if key.endswith("ff.entropy") else dict(rtol=1e-9,
                                                                                atol=1e-12)
        torch.testing.assert_close(out.losses[key].double(), want.double(), **tol,
                                   msg=lambda s: f"{key}: {s}")
    total = sum(v.double() for v in ref.values())
    torch.testing.assert_close(out.aux_loss.double(), total, rtol=1e-5, atol=1e-9)
    # The test tells the authors' pooling from the alternatives and notices a dropped term:
    for alt in (per_application, batch_pooled):
        other = ref_regularisers(record, valid, pool=alt)
        for key in ref:
            assert abs(other[key] - ref[key]) > 1e-3 * abs(ref[key]), (alt.__name__, key)
    attn = sum(v for k, v in ref.items() if "attn" in k)
    assert abs(attn) > 1e-3 * abs(total)  # far above the 1e-5 tolerance of the total


def test_regulariser_gradients_match_the_transcription():
    m = make()
    ids = ids_BT(B=2, T=7)
    params = list(m.parameters())
    ga = torch.autograd.grad(m(ids).aux_loss, params, allow_unused=True)
    record = {}
    moeut_reference(m, ids, record)
    ref = sum(v.double() for v in ref_regularisers(record).values())
    gb = torch.autograd.grad(ref, params, allow_unused=True)
    n_checked = 0
    for (name, _), a, b in zip(m.named_parameters(), ga, gb):
        if b is None:  # the regularisers do not reach the output layer or the last LN2 path
            assert a is None or a.abs().max() == 0, name
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9, msg=lambda s: f"{name}: {s}")
        n_checked += 1
    assert n_checked > 0
    # both selections of both shared blocks are trained by the attention term
    names = [n for n, _ in m.named_parameters()]
    for g in range(G):
        for side in ("src", "dst"):
            assert ga[names.index(f"blocks.{g}.attention.w_router_{side}")].abs().sum() > 0


def test_coefficients_are_options_with_the_papers_defaults():
    cfg = moeut_lm(vocab=V, d=D, L=L, G=G, H=H, d_h=C, att_E=E_ATT, ff_E=E_FF, ff_k=K_FF,
                   expert_size=N_FF, T=16)
    att, ff = cfg.attention_layers()[0], cfg.feedforward_layers()[0]
    assert att.entropy_coef == DELTA and ff.entropy_coef == GAMMA
    assert ff.entropy_pool == "sequence"
    off = moeut_lm(vocab=V, d=D, L=L, G=G, H=H, d_h=C, att_E=E_ATT, ff_E=E_FF, ff_k=K_FF,
                   expert_size=N_FF, T=16, att_entropy_coef=0.0, entropy_coef=0.0)
    torch.manual_seed(0)
    out = off.build()(ids_BT())
    assert out.losses == {} and out.aux_loss == 0
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    # SwitchHead and sigma-MoE outside MoEUT keep their papers' forms (no attention term,
    # the batch-pooled sigma-MoE term), and their JSON does not name the new options.
    from moeify.layers.feedforward import SigmaMoEConfig
    from moeify.layers.switchhead import SwitchHeadConfig
    sh = SwitchHeadConfig(d_model=D, n_heads=H, d_head=C, n_experts=E_ATT, k=2, pos="rope")
    sm = SigmaMoEConfig(d_model=D, n_experts=E_FF, expert_size=N_FF, k=K_FF)
    assert sh.entropy_coef == 0.0 and sm.entropy_pool == "batch"
    with pytest.raises(ValueError, match="entropy_pool"):
        SigmaMoEConfig(d_model=D, n_experts=E_FF, expert_size=N_FF, k=K_FF, entropy_pool="x")
