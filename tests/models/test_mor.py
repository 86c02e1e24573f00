"""Mixture-of-Recursions in the model (ModelConfig.recursion, models/lm.py, models/mor_presets.py):
the paper's parameter counts, Middle-Cycle / Cycle assembly, cost rows, JSON and --set, cached
decoding equal to the full forward, torch.compile(fullgraph) equal to eager, and a few training
steps that lower the loss."""

import dataclasses

import pytest
import torch

from moeify.errors import MoeifyError
from moeify.layers.recursion import MixtureOfRecursions, MoRConfig
from moeify.models.config import ModelConfig
from moeify.models.cost import model_cost
from moeify.models.params import model_parameters
from moeify.models.presets import PRESETS, get_preset
from moeify.train.overrides import apply_model_overrides
from lm_checks import compiled_blocks_match_eager, train_steps

SMALL = ("model.d_model=32", "model.context_length=16", "model.attention.n_heads=2",
         "model.feedforward.d_ff=64")


def _small(preset, *extra):
    return apply_model_overrides(get_preset(preset), SMALL + extra)


def _non_embedding(name):
    parts = model_parameters(get_preset(name))
    return parts["total"] - parts["embedding"]


def test_paper_rows_print_the_papers_non_embedding_counts():
    # Table 3 (fixed FLOPs): vanilla SmolLM-360M 315M, MoR N_r = 3 Middle-Cycle 118M
    vanilla = _non_embedding("mor-360m-vanilla")
    assert vanilla == 32 * (2 * 960 * 960 + 2 * 960 * 320 + 3 * 960 * 2560 + 2 * 960) + 960
    assert round(vanilla / 1e6) == 315
    for name in ("mor-360m-expert", "mor-360m-token"):
        n = _non_embedding(name)
        assert n == (vanilla - 960) // 32 * 12 + 960 + 3 * 960  # 12 distinct layers + routers
        assert round(n / 1e6) == 118
        assert PRESETS[name].baseline == "mor-360m-vanilla"


def test_repro_mor_is_repro_rope_dense_built_as_mor():
    dense, mor = get_preset("repro-rope-dense"), get_preset("repro-mor")
    assert dataclasses.replace(mor, recursion=None) == dense
    assert PRESETS["repro-mor"].baseline == "repro-rope-dense"
    d, b = model_parameters(dense)["total"], model_parameters(mor)["total"]
    block = (d - model_parameters(dataclasses.replace(dense, n_layers=1, attention=(
        dataclasses.replace(dense.attention[0], n_layers=1),), feedforward=(
        dataclasses.replace(dense.feedforward[0], n_layers=1),)))["total"]) // 3
    assert b == d - block + 2 * 128  # one block fewer, two routers of d
    model = mor.build()
    assert isinstance(model.blocks[1], MixtureOfRecursions) and len(model.blocks) == 3
    assert len(model.blocks[1].blocks) == 1
    rows = model_cost(mor).layers
    assert [r["tokens"] for r in rows] == [128, 128, 64, 128]
    assert [r.get("recursion") for r in rows] == [None, 0, 1, None]


def test_cycle_sharing_and_depth_errors():
    cfg = _small("repro-mor", "model.recursion.sharing=cycle")
    model = cfg.build()
    assert len(model.blocks) == 1 and len(model.blocks[0].blocks) == 2
    with pytest.raises(ValueError, match="multiple of n_recursions=3"):
        _small("repro-mor", "model.recursion.n_recursions=3")
    with pytest.raises(ValueError, match="XL memory"):
        dataclasses.replace(get_preset("repro-mor"), xl_memory=True)
    with pytest.raises(ValueError, match="no recursion"):
        apply_model_overrides(get_preset("repro-rope-dense"), ["model.recursion.routing=token"])
    with pytest.raises(ValueError, match="upcycling does not apply"):
        from moeify.models.upcycle import check_dense
        check_dense(get_preset("repro-mor"))
    from moeify.interop.hf_export import hf_config
    with pytest.raises(MoeifyError, match="Mixture-of-Recursions"):
        hf_config(get_preset("repro-mor"), None)


def test_json_round_trip_and_overrides():
    cfg = _small("repro-mor", "model.recursion.routing=token",
                 "model.recursion.capacities=1,0.25")
    assert cfg.recursion.d_model == 32 and cfg.recursion.capacities == (1.0, 0.25)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    plain = get_preset("repro-rope-dense")
    assert "recursion" not in plain.to_dict()  # model.json of other models unchanged


@pytest.mark.parametrize("extra", [("model.recursion.routing=token",),
                                   ("model.recursion.capacities=1,1",),
                                   ("model.recursion.routing=token",
                                    "model.recursion.kv_sharing=true")])
def test_cached_decoding_equals_the_full_forward(extra):
    # token-choice is causal; expert-choice at full capacity keeps every token at every step
    cfg = _small("repro-mor", *extra)
    torch.manual_seed(0)
    model = cfg.build().eval()
    ids = torch.randint(0, 256, (2, 13))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        parts = [model(ids[:, :6], cache=cache).logits]
        parts += [model(ids[:, t:t + 1], cache=cache).logits for t in range(6, 13)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_compiled_fullgraph_matches_eager(routing):
    # expert-choice's gathers have static shapes (K_r from T), token-choice masks: both trace
    # as one graph per module (fullgraph raises on a break); KV sharing compiles in
    # tests/layers/test_recursion_kv_sharing.py
    eager, compiled = compiled_blocks_match_eager(
        _small("repro-mor", f"model.recursion.routing={routing}"))
    assert torch.equal(compiled.blocks[1].usage, eager.blocks[1].usage)


@pytest.mark.parametrize("routing,kv", [("expert", "false"), ("token", "false"),
                                        ("expert", "true")])
def test_a_few_training_steps_lower_the_loss(routing, kv):
    model, out, losses = train_steps(_small("repro-mor", f"model.recursion.routing={routing}",
                                            f"model.recursion.kv_sharing={kv}"))
    assert losses[-1] < losses[0] - 0.2
    key = "layers.1.mor.router_bce" if routing == "expert" else "layers.1.mor.balance"
    assert key in out.losses and model.blocks[1].w_router.grad.abs().sum() > 0
    assert out.stats["layers.1.mor.mean_depth"] >= 1


def test_kv_sharing_cost_rows_count_queries_over_the_first_steps_keys():
    # repro-mor: d 128, 8 heads of 16, T 128, N_r = 2 with capacities (1, 1/2). Step 1 runs 64
    # queries over step 0's 128 keys and projects no K or V:
    # 2·H·d_h·64·128 (attention) + 2·d·H·d_h·64 (Q, O); memory 2·H·64·128 + 2·H·d_h·64
    H, dh, d = 8, 16, 128
    cfg = apply_model_overrides(get_preset("repro-mor"), ["model.recursion.kv_sharing=true"])
    rows = model_cost(cfg).layers
    plain = model_cost(get_preset("repro-mor")).layers
    assert [r["tokens"] for r in rows] == [128, 128, 64, 128]
    assert [r.get("kv_shared", False) for r in rows] == [False, False, True, False]
    assert rows[2]["macs"] == 2 * H * dh * 64 * 128 + 2 * d * H * dh * 64
    assert rows[2]["memory"] == 2 * H * 64 * 128 + 2 * H * dh * 64
    assert rows[2]["macs"] < plain[2]["macs"]  # no K, V projections outweighs 64 x 128 keys
    assert [r["macs"] for i, r in enumerate(rows) if i != 2] == \
        [r["macs"] for i, r in enumerate(plain) if i != 2]
    # the paper's Llama rows: GQA, step r > 0 counts H = 15 query heads over T keys
    big = model_cost(dataclasses.replace(get_preset("mor-360m-expert"), recursion=(
        dataclasses.replace(get_preset("mor-360m-expert").recursion, kv_sharing=True)))).layers
    shared = [r for r in big if r.get("kv_shared")]
    assert len(shared) == 20 and {r["tokens"] for r in shared} == {1365, 682}
    r = shared[0]
    assert r["macs"] == 2 * 15 * 64 * r["tokens"] * 2048 + 2 * 960 * 15 * 64 * r["tokens"]


def test_kv_sharing_is_a_field_and_refuses_attention_it_does_not_cover():
    cfg = _small("repro-mor", "model.recursion.kv_sharing=true")
    assert cfg.recursion.kv_sharing is True
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert len(cfg.build().blocks[1].new_cache().caches) == 1
    with pytest.raises(ValueError, match="kv_sharing must be True or False"):
        MoRConfig(d_model=8, kv_sharing="yes")
    from moeify.layers.switchhead import SwitchHeadConfig
    sh = SwitchHeadConfig(d_model=128, n_heads=2, d_head=64, n_experts=4, k=2, pos="rope",
                          n_layers=4)
    with pytest.raises(ValueError, match="dense and grouped-query attention"):
        dataclasses.replace(get_preset("repro-mor"), attention=sh, recursion=MoRConfig(
            d_model=128, n_recursions=2, kv_sharing=True))
