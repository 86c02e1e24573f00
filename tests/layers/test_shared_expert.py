"""Shared experts (DeepSeekMoE) of sigma-MoE and Switch: the output is the routed layer's plus
the shared expert's, and moeify's parameter accounting counts them."""

import dataclasses

import pytest
import torch

from moeify.layers.sigma_moe import SigmaMoEConfig
from moeify.layers.switch_ff import SwitchFFConfig
from moeify.models.params import model_parameters
from moeify.models.presets import get_preset

D, G = 16, 8


@pytest.mark.parametrize("make", [
    lambda **kw: SigmaMoEConfig(d_model=D, n_experts=4, expert_size=G, k=2, **kw),
    lambda **kw: SwitchFFConfig(d_model=D, d_ff=G, n_experts=4, k=1, dropless=True, **kw),
    lambda **kw: SwitchFFConfig(d_model=D, d_ff=G, n_experts=4, k=2, dropless=True, gated=True,
                                activation="silu", **kw),
])
def test_shared_experts_add_a_dense_expert_of_the_routed_form(make):
    torch.manual_seed(0)
    plain = make().build()
    shared = make(n_shared=2).build()
    shared.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(2, 5, D, dtype=torch.float32)
    y_plain, _ = plain(x)
    y, _ = shared(x)
    s, _ = shared.shared(x)
    torch.testing.assert_close(y, y_plain + s)
    # The routed experts' form and width times n_shared (DeepSeekMoE).
    n_proj = 3 if getattr(shared.config, "gated", False) else 2
    extra = sum(p.numel() for p in shared.shared.parameters())
    assert extra == n_proj * D * 2 * G
    y.sum().backward()
    assert all(p.grad is not None for p in shared.shared.parameters())


def test_shared_options_are_checked():
    with pytest.raises(ValueError, match="n_shared"):
        SigmaMoEConfig(d_model=D, n_experts=4, expert_size=G, k=2, n_shared=-1)
    with pytest.raises(ValueError, match="shared_gate"):
        SigmaMoEConfig(d_model=D, n_experts=4, expert_size=G, k=2, shared_gate=True)


def test_parameter_accounting_counts_the_shared_experts():
    base = get_preset("tiny-sigmamoe")
    ff = base.feedforward[0]  # a pattern: one config per repeating position
    with_shared = dataclasses.replace(
        base, feedforward=tuple(dataclasses.replace(f, n_shared=1) for f in base.feedforward))
    before, after = model_parameters(base), model_parameters(with_shared)
    per_layer = 2 * ff.d_model * ff.expert_size
    assert after["feedforward"] - before["feedforward"] == base.n_layers * per_layer
    assert after["total"] - before["total"] == base.n_layers * per_layer
    assert type(with_shared).from_dict(with_shared.to_dict()) == with_shared
