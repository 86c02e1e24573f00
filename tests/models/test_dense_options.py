"""The ModelConfig options of the Hugging Face families (norm, learned positions, tied or
bias-free output layer): JSON round trip, old configs unchanged, and the model's output against
a plain composition of its parts."""

from __future__ import annotations

import json

import pytest
import torch

from moeify.layers.gqa import GroupedQueryAttentionConfig
from moeify.layers.mlp import GatedMLPConfig
from moeify.layers.norm import NormConfig
from moeify.models.config import ModelConfig
from moeify.models.presets import get_preset

pytestmark = pytest.mark.usefixtures("single_thread")


def _hf_style_config(**changes) -> ModelConfig:
    L, D = 2, 16
    base = dict(vocab_size=40, d_model=D, n_layers=L, context_length=8, xl_memory=False,
                attention=GroupedQueryAttentionConfig(d_model=D, n_heads=4, n_kv_heads=2,
                                                      d_head=4, n_layers=L),
                feedforward=GatedMLPConfig(d_model=D, d_ff=24, n_layers=L),
                norm=NormConfig(kind="rmsnorm", eps=1e-6, bias=False), max_positions=8,
                tie_embeddings=True, output_bias=False)
    return ModelConfig(**{**base, **changes})


def test_new_options_round_trip_and_old_configs_read_as_before():
    cfg = _hf_style_config()
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    old = get_preset("tiny-switchhead")
    assert not {"norm", "max_positions", "tie_embeddings", "output_bias"} & set(old.to_dict())
    assert json.loads(old.to_json()) == json.loads(ModelConfig.from_json(old.to_json()).to_json())
    with pytest.raises(ValueError, match="tied output layer has no bias"):
        _hf_style_config(output_bias=True)


def test_tied_embeddings_and_learned_positions():
    torch.manual_seed(2)
    model = _hf_style_config().build().eval()
    assert model.output is None and not any("output" in k for k in model.state_dict())
    ids = torch.randint(0, 40, (2, 8))
    h = model.embedding(ids) + model.pos_embedding.weight[:8]
    for block in model.blocks:
        h = block(h)[0]
    want = model.ln_f(h) @ model.embedding.weight.t()
    assert torch.allclose(model(ids).logits, want, atol=1e-6)
    cache = model.new_cache()
    steps = [model(ids[:, :3], cache=cache).logits] + [
        model(ids[:, t:t + 1], cache=cache).logits for t in range(3, 8)]
    assert torch.allclose(torch.cat(steps, 1), want, atol=1e-5)
    with pytest.raises(ValueError, match="learned positions for 8 tokens"):
        model(torch.zeros(1, 9, dtype=torch.long))
    n = sum(p.numel() for p in model.parameters())
    from moeify.models.cost import model_cost

    cost = model_cost(_hf_style_config())
    assert cost.params == n and cost.params_by_part["output"] == 0
    assert cost.layers[0]["attention"] == "GQA H=4 Hk=2 d_h=4 rope"
