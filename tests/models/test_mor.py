"""Mixture-of-Recursions in the model (ModelConfig.recursion, models/lm.py, models/mor_presets.py):
the paper's parameter counts, Middle-Cycle / Cycle assembly, cost rows, JSON and --set, cached
decoding equal to the full forward, torch.compile(fullgraph) equal to eager, and a few training
steps that lower the loss."""

import copy
import dataclasses

import pytest
import torch

from moeify.errors import MoeifyError
from moeify.layers.recursion import MixtureOfRecursions, MoRConfig
from moeify.models.config import ModelConfig
from moeify.models.cost import model_cost, model_parameters
from moeify.models.presets import PRESETS, get_preset
from moeify.train.overrides import apply_model_overrides

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
                                   ("model.recursion.capacities=1,1",)])
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
def test_compiled_fullgraph_matches_eager(routing, backend="aot_eager"):
    # expert-choice's gathers have static shapes (K_r from T), token-choice masks: both trace
    # as one graph per module (fullgraph raises on a break). aot_eager traces forward and
    # backward as inductor does, without its code generation (minutes per model on a busy CPU)
    torch._dynamo.reset()
    cfg = _small("repro-mor", f"model.recursion.routing={routing}")
    torch.manual_seed(0)
    eager = cfg.build().train()
    compiled = copy.deepcopy(eager)
    for block in compiled.blocks:
        block.compile(fullgraph=True, backend=backend)  # raises on a graph break
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (eager, compiled):
        out = m(ids[:, :-1], ids[:, 1:])
        (out.loss + out.aux_loss).backward()
        outs.append((out, {n: p.grad for n, p in m.named_parameters()}))
    (oe, ge), (oc, gc) = outs
    torch.testing.assert_close(oc.loss, oe.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(oc.aux_loss, oe.aux_loss, rtol=0, atol=1e-6)
    for name in ge:
        torch.testing.assert_close(gc[name], ge[name], rtol=1e-4, atol=1e-5, msg=name)
    assert torch.equal(compiled.blocks[1].usage, eager.blocks[1].usage)


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_a_few_training_steps_lower_the_loss(routing):
    cfg = _small("repro-mor", f"model.recursion.routing={routing}")
    torch.manual_seed(0)
    model = cfg.build().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(6):
        out = model(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        out.total_loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] - 0.2
    key = "layers.1.mor.router_bce" if routing == "expert" else "layers.1.mor.balance"
    assert key in out.losses and model.blocks[1].w_router.grad.abs().sum() > 0
    assert out.stats["layers.1.mor.mean_depth"] >= 1
