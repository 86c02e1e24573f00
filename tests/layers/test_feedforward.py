"""Dense feedforward (the paper baseline's MLP) against a hand transcription of the SwitchHead
appendix."""

import dataclasses
import math

import pytest
import torch

from moeify.layers import feedforward
from moeify.layers.feedforward import DenseFeedForward, DenseFFConfig
from references import assert_same_outputs_and_gradients


def _reference(x, w1, b1, w2, b2):
    # SwitchHead appendix: W2 · ReLU(W1 · x + b1) + b2, written with einsum (no nn.Linear).
    h = torch.relu(torch.einsum("btd,fd->btf", x, w1) + b1)
    return torch.einsum("btf,df->btd", h, w2) + b2


def test_dense_ff_matches_hand_transcription_outputs_and_gradients():
    torch.manual_seed(0)
    ff = DenseFFConfig(d_model=6, d_ff=10, n_layers=4).build().double()
    with torch.no_grad():  # non-zero biases so that they are exercised
        ff.w1.bias.normal_()
        ff.w2.bias.normal_()
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    y, aux = ff(x)
    assert aux.losses == {} and aux.stats == {}
    params = [ff.w1.weight, ff.w1.bias, ff.w2.weight, ff.w2.bias]
    refs = [p.detach().clone().requires_grad_() for p in params]
    xr = x.detach().clone().requires_grad_()
    y_ref = _reference(xr, *refs)
    assert_same_outputs_and_gradients(y, y_ref, x, xr, params, refs)


def test_dense_ff_init_scale_and_zero_biases():
    torch.manual_seed(0)
    L, d, f = 8, 256, 512
    ff = DenseFFConfig(d_model=d, d_ff=f, n_layers=L).build()
    for lin, fan_in in ((ff.w1, d), (ff.w2, f)):
        std = math.sqrt(2 / (L * fan_in))
        # the authors' init: truncated at ±2, then rescaled to std exactly sigma
        assert abs(lin.weight.std().item() / std - 1) < 1e-5
        assert lin.weight.abs().max().item() <= 2.35 * std
        assert torch.count_nonzero(lin.bias) == 0


def test_dense_ff_dropout_is_inner_and_training_only():
    torch.manual_seed(0)
    ff = DenseFFConfig(d_model=4, d_ff=64, dropout=0.5).build().double()
    x = torch.randn(3, 4, 4, dtype=torch.float64)
    ff.eval()
    y_eval, _ = ff(x)
    torch.testing.assert_close(y_eval, _reference(x, ff.w1.weight, ff.w1.bias,
                                                  ff.w2.weight, ff.w2.bias))
    ff.train()
    torch.manual_seed(1)
    y_train, _ = ff(x)
    # Reproduce the hidden-layer mask: dropout acts on the hidden units, not on the output.
    torch.manual_seed(1)
    h = torch.relu(x @ ff.w1.weight.T + ff.w1.bias)
    h = torch.nn.functional.dropout(h, 0.5, training=True)
    torch.testing.assert_close(y_train, h @ ff.w2.weight.T + ff.w2.bias)
    assert not torch.allclose(y_train, y_eval)


@pytest.mark.parametrize("bad", [dict(d_ff=0), dict(d_model=-1), dict(dropout=1.0),
                                 dict(dropout=-0.1), dict(n_layers=0), dict(d_ff=8.0),
                                 dict(n_layers=True)])
def test_dense_ff_config_validation(bad):
    kw = dict(d_model=4, d_ff=8) | bad
    with pytest.raises(ValueError, match="DenseFFConfig"):
        DenseFFConfig(**kw)


@pytest.mark.parametrize("cfg", [
    DenseFFConfig(d_model=4, d_ff=8),
    feedforward.SigmaMoEConfig(d_model=4, n_experts=3, expert_size=2, k=2),
    feedforward.SwitchFFConfig(d_model=4, d_ff=8, n_experts=3),
])
def test_wrong_input_shapes_name_the_expected_shape(cfg):
    ff = cfg.build()
    with pytest.raises(ValueError, match=r"d_model=4\], got \(2, 3, 5\)"):
        ff(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match=r"valid_BT must be \[batch, tokens\] = \[2, 3\]"):
        ff(torch.randn(2, 3, 4), valid_BT=torch.ones(2, 4, dtype=torch.bool))


def test_configs_are_frozen_keyword_only_and_entry_point_reexports():
    cfg = DenseFFConfig(d_model=4, d_ff=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_ff = 3
    with pytest.raises(TypeError):
        DenseFFConfig(4, 8)
    assert isinstance(dataclasses.replace(cfg, d_ff=3).build(), DenseFeedForward)
    for name in ("SigmaMoEConfig", "SigmaMoE", "SwitchFFConfig", "SwitchFeedForward"):
        assert hasattr(feedforward, name)


def test_exact_std_truncated_normal_is_a_rescaled_truncated_normal():
    from moeify.layers.common import trunc_normal_exact_std_

    torch.manual_seed(0)
    plain = torch.nn.init.trunc_normal_(torch.empty(400, 300), std=1.0, a=-2.0, b=2.0)
    torch.manual_seed(0)
    w = trunc_normal_exact_std_(torch.empty(400, 300), 0.05)
    torch.testing.assert_close(w, plain * (0.05 / plain.std()))
    assert 0.87 < plain.std().item() < 0.89  # why the rescaling matters
