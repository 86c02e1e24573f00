"""Checkpoints written before the naming convention of moeify.layers.common (router weights
``w_router*``, stacked expert weights ``w_<role>``, expert biases ``bias_in`` / ``bias_out``)
still load: a state dict carrying the earlier names loads, strictly, into the current layer and
gives the same output as the layer it was taken from.

The earlier names are written out here, not read from the layers' rename tables, so that the
test fails if a table forgets or misspells one."""

import pytest
import torch

from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.block import TransformerBlock
from moeify.layers.common import upgrade_legacy_keys
from moeify.layers.depth import MixtureOfDepths, MoDConfig
from moeify.layers.feedforward import (SigmaMoE, SigmaMoEConfig, SwitchFeedForward,
                                       SwitchFFConfig)
from moeify.layers.mosa import MoSAAttention, MoSAConfig
from moeify.layers.switchhead import SwitchHeadAttention, SwitchHeadConfig
from moeify.models.presets import get_preset
from moeify.train.config import apply_model_overrides

pytestmark = pytest.mark.usefixtures("single_thread")

D = 16

# current name -> the name a checkpoint written before the convention holds
SWITCHHEAD = {"w_router": "w_sel", "w_router_src": "w_sel_src", "w_router_dst": "w_sel_dst"}
SIGMA = {"w_router": "w_sel_ED", "w_in": "keys_EDG", "w_out": "values_EGD",
         "bias_in": "bias_EG", "bias_out": "bias_D"}
SWITCH = {"w_router": "w_router_RD", "w_in": "w_in_EDF", "w_out": "w_out_EFD",
          "w_gate": "w_gate_EDF", "bias_in": "bias_EF", "bias_out": "bias_D"}
MOD = {"w_router": "router_D", "bias_router": "router_bias"}
MOSA = {"w_router": "w_r"}
LEGACY = {SwitchHeadAttention: SWITCHHEAD, SigmaMoE: SIGMA, SwitchFeedForward: SWITCH,
          MixtureOfDepths: MOD, MoSAAttention: MOSA}


def _old_state(model) -> dict:
    """``model``'s state dict as a checkpoint written before the convention holds it: each
    layer's entries under their earlier names (same order, same tensors)."""
    state = model.state_dict()
    renames = {}
    for prefix, module in model.named_modules():
        for new, old in LEGACY.get(type(module), {}).items():
            key = f"{prefix}.{new}" if prefix else new
            if key in state:
                renames[key] = f"{prefix}.{old}" if prefix else old
    return {renames.get(k, k): v for k, v in state.items()}


def _block(attention_cfg, ff_cfg):
    return TransformerBlock(D, attention_cfg.build(), ff_cfg.build())


LAYERS = {
    "switchhead": (lambda: SwitchHeadConfig(d_model=D, n_heads=2, d_head=4, n_experts=3, k=2,
                                            experts=frozenset("qkvo"), pos="rope").build(),
                   ("w_sel_src", "w_sel_dst")),
    "switchhead_shared": (lambda: SwitchHeadConfig(d_model=D, n_heads=2, d_head=4, n_experts=3,
                                                   k=2, shared_selection=True,
                                                   pos="xl").build(),
                          ("w_sel",)),
    "sigma_moe": (lambda: SigmaMoEConfig(d_model=D, n_experts=4, expert_size=8, k=2,
                                         bias=True).build(),
                  ("w_sel_ED", "keys_EDG", "values_EGD", "bias_EG", "bias_D")),
    "switch": (lambda: SwitchFFConfig(d_model=D, d_ff=8, n_experts=4, k=2, bias=True,
                                      noop_experts=1, dropless=True).build(),
               ("w_router_RD", "w_in_EDF", "w_out_EFD", "bias_EF", "bias_D")),
    "switch_gated": (lambda: SwitchFFConfig(d_model=D, d_ff=8, n_experts=4, k=2, gated=True,
                                            dropless=True).build(),
                     ("w_router_RD", "w_in_EDF", "w_out_EFD", "w_gate_EDF")),
    "mod": (lambda: MoDConfig(d_model=D, capacity=0.5).build(
                _block(DenseAttentionConfig(d_model=D, n_heads=2, d_head=4, pos="rope"),
                       SigmaMoEConfig(d_model=D, n_experts=4, expert_size=8, k=2))),
            ("router_D", "router_bias", "block.feedforward.w_sel_ED",
             "block.feedforward.keys_EDG", "block.feedforward.values_EGD")),
    "mosa": (lambda: MoSAConfig(d_model=D, n_heads=2, d_head=4, sparsity=2).build(),
             ("w_r",)),
}


@pytest.mark.parametrize("name", LAYERS)
def test_old_state_dict_loads_and_gives_the_same_output(name):
    build, expected_old = LAYERS[name]
    torch.manual_seed(0)
    src = build().double().eval()
    with torch.no_grad():  # make the zero-initialised biases matter
        for key, p in src.named_parameters():
            if key.rpartition(".")[2] in ("bias_in", "bias_out", "bias_router"):
                p.normal_(0.0, 0.1)
    old = _old_state(src)
    assert set(expected_old) <= set(old), sorted(old)
    renamed = set(src.state_dict()) - set(old)
    assert len(renamed) == len(expected_old), sorted(renamed)

    torch.manual_seed(1)
    dst = build().double().eval()
    dst.load_state_dict(old, strict=True)  # raises on a missing or unexpected key
    for key, value in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[key], value, rtol=0, atol=0)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    torch.testing.assert_close(dst(x)[0], src(x)[0], rtol=0, atol=0)


def test_both_names_keep_the_current_one():
    """A state dict with a key under both names loads the current one; the earlier stays
    unexpected (strict loading refuses it, non-strict reports it)."""
    torch.manual_seed(0)
    src = SigmaMoEConfig(d_model=D, n_experts=4, expert_size=8, k=2).build()
    state = src.state_dict()
    state["w_sel_ED"] = torch.zeros_like(state["w_router"])
    dst = SigmaMoEConfig(d_model=D, n_experts=4, expert_size=8, k=2).build()
    with pytest.raises(RuntimeError, match="w_sel_ED"):
        dst.load_state_dict(state, strict=True)
    result = dst.load_state_dict(state, strict=False)
    assert result.unexpected_keys == ["w_sel_ED"] and not result.missing_keys
    torch.testing.assert_close(dst.w_router, src.w_router, rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["tiny-switchall", "tiny-mode"])
def test_old_model_checkpoint_loads(preset):
    """A whole model's state dict (prefixed keys: blocks.i.attention..., the MoD block's
    block.feedforward...) with the earlier names: ``load_state_dict`` reads it, and
    ``upgrade_legacy_keys`` gives exactly the current state dict's keys."""
    cfg = apply_model_overrides(get_preset(preset), ("model.d_model=32", "model.n_layers=2",
                                                     "model.context_length=16"))
    torch.manual_seed(0)
    src = cfg.build().eval()
    state = src.state_dict()
    old = _old_state(src)
    assert old.keys() != state.keys()
    upgraded = upgrade_legacy_keys(src, old)
    assert list(upgraded) != list(old) and set(upgraded) == set(state)
    assert all(torch.equal(upgraded[k], state[k]) for k in state)
    torch.manual_seed(1)
    dst = cfg.build().eval()
    dst.load_state_dict(old, strict=True)
    ids = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(dst(ids).logits, src(ids).logits, rtol=0, atol=0)
