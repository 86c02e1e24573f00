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
    sigma-MoE router works in float32 from its inputs on (moe-family.md)."""
    B, T, _ = x.shape
    s = torch.sigmoid(r.float() @ ff.w_router.float().t()).reshape(B * T, E_FF)
    g, idx = s.topk(K_FF, -1)
    y = ref_expert_mlp(x.reshape(B * T, D), idx, ff.w_in, ff.w_out, g.to(x.dtype))
    return y.view(B, T, D)


def moeut_reference(m, ids):
    x = m.embedding.weight[ids]
    for i in range(L):  # layer grouping: application i runs block i mod G
        blk = m.blocks[i % G]
        x = x + ref_switchhead(blk.attention, ref_ln(x, blk.ln1), x)
        x = x + ref_sigma_moe(blk.feedforward, x, ref_ln(x, blk.ln2))
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
        m.blocks[1].feedforward.w_out.mul_(2.0)
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
                   (ff.w_in, s / 16), (ff.w_out, s / math.sqrt(8 * 64))):
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
