"""ReMoE in the model (moeify.models.remoe_presets): the paper rows' shapes and counts, the CPU
study row against its dense baseline, fullgraph compile equal to eager, a few training steps."""

import pytest
import torch

from moeify.layers.remoe import ReMoEConfig
from moeify.models.cost import model_cost
from moeify.models.params import model_parameters
from moeify.models.presets import get_preset
from moeify.train.config import apply_model_overrides
from lm_checks import compiled_blocks_match_eager, train_steps

SMALL = ("model.d_model=32", "model.n_layers=2", "model.context_length=16",
         "model.feedforward.init_std=0.2")


def _small():
    return apply_model_overrides(get_preset("repro-remoe"), SMALL)


@pytest.mark.parametrize("size,L,d", [("182m", 12, 768), ("469m", 24, 1024),
                                      ("978m", 24, 1536)])
def test_paper_rows_are_the_authors_scripts(size, L, d):
    cfg = get_preset(f"remoe-{size}")
    ff = cfg.feedforward[0]
    assert (cfg.n_layers, cfg.d_model, cfg.context_length, cfg.vocab_size) == (L, d, 1024, 51200)
    assert isinstance(ff, ReMoEConfig) and (ff.n_experts, ff.k, ff.expert_size) == (8, 1, 4 * d)
    assert ff.gated and ff.l1_coef_init == 1e-8 and ff.l1_multiplier == 1.2
    # Hand count: 8 SwiGLU experts of 3 · d · 4d and a router of 8 · d per layer.
    assert model_parameters(cfg)["feedforward"] == L * (8 * 3 * d * 4 * d + 8 * d)


def test_repro_row_splits_the_dense_mlp_and_counts_macs_at_the_target():
    dense, remoe = get_preset("repro-rope-dense"), get_preset("repro-remoe")
    pd, pr = model_parameters(dense), model_parameters(remoe)
    # The dense MLP's 2 · 128 · 512 weights (+ 512 + 128 biases) become 8 experts of 64 units
    # (no biases) plus the 8 x 128 router, in each of the 4 layers.
    assert pd["feedforward"] == 4 * (2 * 128 * 512 + 512 + 128)
    assert pr["feedforward"] == 4 * (2 * 128 * 512 + 8 * 128)
    assert pr["attention"] == pd["attention"]
    assert remoe.feedforward[0].init_std == 0.0625  # sqrt(2 / 4) / sqrt(128): the family's
    row = model_cost(remoe).remoe[0]
    assert row["macs_per_token"] == 8 * 128 + 2 * (2 * 128 * 64)  # target k = 2


def test_compiled_fullgraph_matches_eager():
    # SwiGLU experts (the authors'): the registered op's w_up and its gradient are traced too
    eager, compiled = compiled_blocks_match_eager(apply_model_overrides(
        _small(), ("model.feedforward.gated=true", "model.feedforward.activation=silu")))
    assert torch.equal(compiled.blocks[1].feedforward.usage, eager.blocks[1].feedforward.usage)


def test_a_few_training_steps_lower_the_loss():
    model, out, losses = train_steps(_small())
    assert losses[-1] < losses[0] - 0.2
    assert "layers.1.ff.l1" in out.losses
    assert model.blocks[1].feedforward.w_router.grad.abs().sum() > 0
    assert 0 < out.stats["layers.1.ff.experts_per_token"] <= 8
