"""ReMoE (moeify.layers.remoe) against the equations of arXiv 2412.14711 Sec. 3 transcribed in
tests/references.py, float64: output, every gradient, the L1 regulariser, the coefficient's
update, padding (the model-level compile test: tests/models/test_remoe_model.py)."""

import pytest
import torch

from moeify.layers.remoe import ReMoEConfig
from references import ref_remoe_coef_update, ref_remoe_l1, ref_varlen_expert_mlp

f64 = torch.float64


def layer(gated=True, **kw):
    cfg = ReMoEConfig(d_model=12, n_experts=6, expert_size=5, k=2, init_std=0.3, gated=gated,
                      activation="silu" if gated else "relu", l1_coef_init=0.01, **kw)
    torch.manual_seed(0)
    return cfg.build().to(f64).train()


def reference(m, x_BTD, valid_BT=None):
    B, T, D = x_BTD.shape
    x = x_BTD.reshape(B * T, D)
    route = torch.clamp(x @ m.w_router.T, min=0)
    if valid_BT is not None:
        route = route * valid_BT.reshape(-1, 1)
    up = m.w_up if m.config.gated else None
    y = ref_varlen_expert_mlp(x, route, m.w_in, m.w_out, up, m.config.activation)
    keep = route if valid_BT is None else route[valid_BT.reshape(-1)]
    return y.view(B, T, D), m.l1_coef.double() * ref_remoe_l1(keep, m.config.k), route


@pytest.mark.parametrize("gated", [True, False])
def test_matches_the_equations_with_every_gradient(gated):
    m = layer(gated)
    x = torch.randn(2, 7, 12, dtype=f64, requires_grad=True)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 5:] = False
    y, aux = m(x, valid_BT=valid)
    y_ref, l1_ref, route = reference(m, x, valid)
    per_token = (route[valid.reshape(-1)] > 0).sum(1)
    assert per_token.min() < per_token.max()  # a variable number of experts per token
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(aux.losses["l1"], l1_ref, rtol=1e-10, atol=1e-18)
    params = [x] + list(m.parameters())
    g = torch.randn_like(y)
    got = torch.autograd.grad((y * g).sum() + 1e6 * aux.losses["l1"], params)
    want = torch.autograd.grad((y_ref * g).sum() + 1e6 * l1_ref, params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert torch.all(y[1, 5:] == 0)  # padding routes nowhere
    counts = aux.routing["router"].counts[0]
    assert counts[:6].sum() == per_token.sum() and counts.sum() == valid.sum() * 6
    torch.testing.assert_close(aux.stats["sparsity"].double(),
                               1 - per_token.double().mean() / 6)


def test_coefficient_update_follows_the_target_on_the_device():
    m = layer()
    lam = m.l1_coef.item()
    for s in (0.1, 0.9, 0.7, 0.5):  # target 1 - 2/6
        m.update_l1_coef(torch.tensor(s))
        lam = ref_remoe_coef_update(lam, s, 2, 6, 1.2)
        assert m.l1_coef.item() == pytest.approx(lam, rel=1e-6)
    m.to(torch.bfloat16)
    assert m.l1_coef.dtype == torch.float32  # lambda keeps float32


def test_bad_config_is_a_one_line_error():
    with pytest.raises(ValueError, match="target active experts"):
        ReMoEConfig(d_model=8, n_experts=4, expert_size=4, k=5)
    with pytest.raises(ValueError, match="alpha"):
        ReMoEConfig(d_model=8, n_experts=4, expert_size=4, l1_multiplier=1.0)
