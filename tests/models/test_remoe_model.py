"""ReMoE in the model (moeify.models.remoe_presets): the paper rows' shapes and counts, the CPU
study row against its dense baseline, fullgraph compile equal to eager, a few training steps."""

import copy

import pytest
import torch

from moeify.layers.remoe import ReMoEConfig
from moeify.models.cost import model_cost, model_parameters
from moeify.models.presets import get_preset
from moeify.train.config import apply_model_overrides

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
    row = model_cost(remoe).remoe[0]
    assert row["macs_per_token"] == 8 * 128 + 2 * (2 * 128 * 64)  # target k = 2


def test_compiled_fullgraph_matches_eager():
    # SwiGLU experts (the authors'): the registered op's w_up and its gradient are traced too
    torch._dynamo.reset()
    cfg = apply_model_overrides(_small(), ("model.feedforward.gated=true",
                                           "model.feedforward.activation=silu"))
    torch.manual_seed(0)
    eager = cfg.build().train()
    compiled = copy.deepcopy(eager)
    for block in compiled.blocks:
        block.compile(fullgraph=True, backend="aot_eager")  # raises on a graph break
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
    assert torch.equal(compiled.blocks[1].feedforward.usage, eager.blocks[1].feedforward.usage)


def test_a_few_training_steps_lower_the_loss():
    cfg = _small()
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
    assert "layers.1.ff.l1" in out.losses
    assert model.blocks[1].feedforward.w_router.grad.abs().sum() > 0
    assert 0 < out.stats["layers.1.ff.experts_per_token"] <= 8
