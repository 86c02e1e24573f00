"""State dicts of runs whose feedforward MoEs held their expert weights themselves
(``feedforward.w_in``, as moeify wrote them before the experts became a sub-module,
moeify.layers.experts) still load: strictly, into the current layers, with the same output; and
``upgrade_legacy_keys`` gives exactly the current keys.

The flat keys are written out here, not read from the layers' table, so that the test fails if
the table forgets or misspells one."""

import pytest
import torch

from moeify.layers.common import upgrade_legacy_keys
from moeify.layers.feedforward import SigmaMoEConfig, SwitchFFConfig
from moeify.models.presets import get_preset
from moeify.train.config import apply_model_overrides

pytestmark = pytest.mark.usefixtures("single_thread")

D = 16
# current key, relative to the layer -> the key the layer held it under
FLAT = {"experts.w_in": "w_in", "experts.w_out": "w_out", "experts.w_gate": "w_gate",
        "experts.bias_in": "bias_in"}


def flat_state(model) -> dict:
    """``model``'s state dict with every expert weight under its layer's own name (same order,
    same tensors), as such a checkpoint holds it."""
    out = {}
    for key, value in model.state_dict().items():
        for new, old in FLAT.items():
            if key == new or key.endswith("." + new):
                key = key[:len(key) - len(new)] + old
                break
        out[key] = value
    return out


LAYERS = {
    "sigma_moe": lambda: SigmaMoEConfig(d_model=D, n_experts=4, expert_size=8, k=2,
                                        bias=True).build(),
    "switch": lambda: SwitchFFConfig(d_model=D, d_ff=8, n_experts=4, k=2, bias=True,
                                     noop_experts=1, dropless=True).build(),
    "switch_gated": lambda: SwitchFFConfig(d_model=D, d_ff=8, n_experts=4, k=2, gated=True,
                                           dropless=True).build(),
}


@pytest.mark.parametrize("name", LAYERS)
def test_flat_state_dict_loads_and_gives_the_same_output(name):
    torch.manual_seed(0)
    src = LAYERS[name]().double().eval()
    with torch.no_grad():  # make the zero-initialised biases matter
        for key, p in src.named_parameters():
            if key.endswith(("bias_in", "bias_out")):
                p.normal_(0.0, 0.1)
    old = flat_state(src)
    assert "w_in" in old and "experts.w_in" not in old
    torch.manual_seed(1)
    dst = LAYERS[name]().double().eval()
    dst.load_state_dict(old, strict=True)  # raises on a missing or unexpected key
    for key, value in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[key], value, rtol=0, atol=0)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    torch.testing.assert_close(dst(x)[0], src(x)[0], rtol=0, atol=0)


def test_both_keys_keep_the_current_one():
    """A state dict holding an expert weight under both keys loads the current one; the flat one
    stays unexpected (strict loading refuses it)."""
    src = SigmaMoEConfig(d_model=D, n_experts=4, expert_size=8, k=2).build()
    state = src.state_dict()
    state["w_in"] = torch.zeros_like(state["experts.w_in"])
    dst = SigmaMoEConfig(d_model=D, n_experts=4, expert_size=8, k=2).build()
    with pytest.raises(RuntimeError, match="w_in"):
        dst.load_state_dict(state, strict=True)
    result = dst.load_state_dict(state, strict=False)
    assert result.unexpected_keys == ["w_in"] and not result.missing_keys
    torch.testing.assert_close(dst.experts.w_in, src.experts.w_in, rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["tiny-switchall", "tiny-mode", "tiny-switch"])
def test_flat_model_checkpoint_loads(preset):
    """A whole model's state dict (prefixed keys; the MoD block's block.feedforward...) with
    flat expert keys: ``load_state_dict`` reads it, ``upgrade_legacy_keys`` gives exactly the
    current keys."""
    cfg = apply_model_overrides(get_preset(preset), ("model.d_model=32", "model.n_layers=2",
                                                     "model.context_length=16"))
    torch.manual_seed(0)
    src = cfg.build().eval()
    state = src.state_dict()
    old = flat_state(src)
    assert old.keys() != state.keys()
    upgraded = upgrade_legacy_keys(src, old)
    assert set(upgraded) == set(state)
    assert all(torch.equal(upgraded[k], state[k]) for k in state)
    torch.manual_seed(1)
    dst = cfg.build().eval()
    dst.load_state_dict(old, strict=True)
    ids = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(dst(ids).logits, src(ids).logits, rtol=0, atol=0)
