"""TransformerLM: XL memory semantics, loss, aux losses, cached decoding, ModelConfig round trip.

The XL reference: with one chunk of memory, the second chunk's logits must equal the last T
positions of ONE forward pass over both chunks without memory (a causal model's block inputs for
the first chunk are the same either way, and every second-chunk query sees all of them)."""

import dataclasses

import pytest
import torch

from moeify.models.config import ModelConfig
from moeify.models.lm import LMOutput, TransformerLM
from moeify.models.presets import (PRESETS, dense_attn, dense_ff, get_preset, mod,
                                   sigma_moe_ff, switchhead_attn)

TINY = [n for n in PRESETS if n.startswith("tiny-")]


def small(attention="dense", pos="xl", xl=True, ff="dense", L=2, d=32, V=50, T=8, depth=None):
    if attention == "dense":
        att = dense_attn(d=d, L=L, H=2, d_h=8, pos=pos)
    else:
        att = switchhead_attn(d=d, L=L, H=2, d_h=8, E=3, k=2, pos=pos)
    f = (dense_ff(d=d, L=L, d_ff=64, dropout=0.0) if ff == "dense" else
         sigma_moe_ff(d=d, L=L, E=4, G=16, k=2, entropy_coef=1e-2, expert_dropout=0.0))
    return ModelConfig(vocab_size=V, d_model=d, n_layers=L, context_length=T, attention=att,
                       feedforward=f, depth=depth, xl_memory=xl, dropout=0.0)


def model_of(cfg, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return TransformerLM(cfg).to(dtype).eval()


@pytest.mark.parametrize("attention", ["dense", "switchhead"])
def test_xl_memory_equals_one_pass_over_both_chunks(attention):
    m = model_of(small(attention=attention))
    ids = torch.randint(0, 50, (2, 16))
    full = m(ids).logits
    first = m(ids[:, :8])
    second = m(ids[:, 8:], memory=first.memory)
    torch.testing.assert_close(first.logits, full[:, :8])
    torch.testing.assert_close(second.logits, full[:, 8:])


def test_xl_memory_carries_and_is_detached():
    m = model_of(small())
    ids = torch.randint(0, 50, (2, 16))
    other = ids.clone()
    other[:, :8] = (other[:, :8] + 1) % 50
    a = m(ids[:, :8])
    b = m(other[:, :8])
    # memory = each block's input: the first block's input is the embedding (eval: no dropout)
    torch.testing.assert_close(a.memory[0], m.embedding.weight[ids[:, :8]])
    assert len(a.memory) == 2 and not any(t.requires_grad for t in a.memory)
    out_a = m(ids[:, 8:], memory=a.memory).logits
    out_b = m(ids[:, 8:], memory=b.memory).logits
    assert (out_a - out_b).abs().max() > 1e-3  # the second call depends on the first's input
    # ... and without memory it does not see the first chunk at all
    torch.testing.assert_close(m(ids[:, 8:]).logits, m(other[:, 8:]).logits)


def test_rope_model_keeps_no_memory():
    m = model_of(small(pos="rope", xl=False))
    out = m(torch.randint(0, 50, (1, 8)))
    assert out.memory is None
    with pytest.raises(ValueError, match="without xl_memory"):
        m(torch.randint(0, 50, (1, 8)), memory=[torch.zeros(1, 8, 32)] * 2)


def test_loss_is_masked_cross_entropy_in_float32():
    m = model_of(small(), dtype=torch.float32)
    ids = torch.randint(0, 50, (2, 8))
    tgt = torch.randint(0, 50, (2, 8))
    valid = torch.rand(2, 8) > 0.3
    valid[0, 0] = True
    out = m(ids, tgt, valid_BT=valid)
    logp = torch.log_softmax(out.logits.double(), -1)
    nll = -logp.gather(-1, tgt[..., None]).squeeze(-1)
    ref = nll[valid].mean()
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)
    # padding targets do not matter
    tgt2 = torch.where(valid, tgt, (tgt + 7) % 50)
    torch.testing.assert_close(m(ids, tgt2, valid_BT=valid).loss, out.loss)
    assert m(ids).loss is None


def test_aux_loss_sums_every_layer_and_has_gradient():
    m = model_of(small(ff="sigma", L=3))
    m.train()
    out = m(torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8)))
    ff_losses = {k: v for k, v in out.losses.items() if ".ff." in k}
    assert sorted(ff_losses) == [f"layers.{i}.ff.entropy" for i in range(3)]
    torch.testing.assert_close(out.aux_loss, sum(out.losses.values()))
    assert any(k.startswith("layers.2.ff.") for k in out.stats)
    assert all(not v.requires_grad for v in out.stats.values())
    torch.testing.assert_close(out.total_loss, out.loss + out.aux_loss)
    sel = [p for n, p in m.named_parameters() if "blocks.1.feedforward" in n]
    grads = torch.autograd.grad(out.aux_loss, sel, allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


def test_dense_model_has_zero_aux_loss():
    out = model_of(small())(torch.randint(0, 50, (1, 8)))
    assert out.aux_loss.shape == () and out.aux_loss.item() == 0.0 and out.losses == {}


@pytest.mark.parametrize("attention,pos,xl", [("dense", "xl", True),
                                              ("switchhead", "rope", False)])
def test_cached_decoding_equals_full_forward(attention, pos, xl):
    m = model_of(small(attention=attention, pos=pos, xl=xl))
    ids = torch.randint(0, 50, (2, 7))
    full = m(ids).logits
    cache = m.new_cache()
    pieces = [m(ids[:, :4], cache=cache).logits]
    for t in range(4, 7):
        pieces.append(m(ids[:, t:t + 1], cache=cache).logits)
    # SwitchHead selects in float32 (SwitchHead Eq. 7-10) even in a float64 model
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-6)


def test_embedding_and_output_layer():
    cfg = small()
    m = TransformerLM(cfg)
    assert m.output.bias is not None
    assert m.output.weight.data_ptr() != m.embedding.weight.data_ptr()  # untied
    torch.manual_seed(0)
    big = TransformerLM(dataclasses.replace(cfg, vocab_size=4000))
    # embedding std 1/sqrt(d) (SwitchHead appendix)
    assert abs(big.embedding.weight.std().item() * cfg.d_model ** 0.5 - 1) < 0.03


def test_dropout_placements_only_act_in_training():
    cfg = dataclasses.replace(small(), dropout=0.5)
    m = model_of(cfg)
    ids = torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(m(ids).logits, m(ids).logits)
    m.train()
    assert (m(ids).logits - m(ids).logits).abs().max() > 0


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_forward_backward_on_cpu(name):
    cfg = get_preset(name)
    assert cfg.vocab_size == 256 and cfg.n_layers == 4
    torch.manual_seed(0)
    m = TransformerLM(cfg).train()
    ids = torch.randint(0, 256, (2, 16))
    out = m(ids, torch.roll(ids, -1, 1))
    assert isinstance(out, LMOutput) and out.logits.shape == (2, 16, 256)
    out.total_loss.backward()
    assert torch.isfinite(out.total_loss)
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
    if cfg.xl_memory:
        out2 = m(ids, memory=out.memory)
        assert out2.logits.shape == (2, 16, 256)


def test_mod_pattern_every_other_block():
    from moeify.layers.depth import MixtureOfDepths

    m = TransformerLM(get_preset("tiny-mod"))
    kinds = [isinstance(b, MixtureOfDepths) for b in m.blocks]
    assert kinds == [False, True, False, True]


# ---------------------------------------------------------------------------- ModelConfig

@pytest.mark.parametrize("name", list(PRESETS))
def test_config_json_round_trip(name):
    cfg = get_preset(name)
    back = ModelConfig.from_json(cfg.to_json())
    assert back == cfg
    assert back.to_dict() == cfg.to_dict()


def test_config_pattern_repeats_over_layers():
    a1 = dense_attn(d=32, L=4, H=2, d_h=8, pos="rope")
    a2 = switchhead_attn(d=32, L=4, H=2, d_h=8, E=3, k=2, pos="rope")
    f = dense_ff(d=32, L=4, d_ff=64, dropout=0.0)
    cfg = ModelConfig(vocab_size=10, d_model=32, n_layers=4, context_length=8,
                      attention=[a1, a2], feedforward=f, depth=(None, mod(d=32, L=4)),
                      xl_memory=False)
    assert cfg.attention_layers() == [a1, a2, a1, a2]
    assert cfg.feedforward_layers() == [f] * 4
    assert [d is None for d in cfg.depth_layers()] == [True, False, True, False]
    assert ModelConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("change,match", [
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(dropout=1.0), "dropout must lie in"),
    (dict(d_model=64), "has d_model=32 but the model has d_model=64"),
    (dict(n_layers=3), "has n_layers=2 but the model has n_layers=3"),
    (dict(attention=None), "attention\\[0\\] is None"),
    (dict(depth=(None, None, None)), "between 1 and n_layers=2"),
    (dict(depth=mod(d=32, L=2)), "cannot be combined with XL memory"),
    (dict(feedforward="relu"), "must be a layer config dataclass"),
])
def test_config_validation(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(small(), **change)


def test_config_from_dict_rejects_unknown():
    d = small().to_dict()
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        ModelConfig.from_dict({**d, "heads": 3})
    d["attention"][0]["type"] = "NoSuchConfig"
    with pytest.raises(ValueError, match="unknown layer config type 'NoSuchConfig'"):
        ModelConfig.from_dict(d)


def test_a_layer_module_that_fails_to_import_says_so(monkeypatch):
    """A layer module that cannot be imported is named with its error, not taken for a module
    without the config (which read as "unknown layer config type"); other tags still read."""
    import sys

    from moeify.errors import MoeifyError
    from moeify.models import config as config_mod

    monkeypatch.setitem(sys.modules, "moeify.layers.broken_for_test", None)  # import fails
    monkeypatch.setattr(config_mod, "LAYER_CONFIG_MODULES",
                        ("moeify.layers.broken_for_test",) + config_mod.LAYER_CONFIG_MODULES)
    d = small().to_dict()
    assert ModelConfig.from_dict(d) == small()
    d["attention"][0]["type"] = "BrokenConfig"
    with pytest.raises(MoeifyError, match=r"moeify\.layers\.broken_for_test failed to import "
                                          r"\(ModuleNotFoundError"):
        ModelConfig.from_dict(d)


def test_forward_rejects_bad_calls():
    m = model_of(small())
    ids = torch.randint(0, 50, (1, 8))
    with pytest.raises(ValueError, match="one tensor per block"):
        m(ids, memory=[torch.zeros(1, 8, 32)])
    with pytest.raises(ValueError, match="not both"):
        m(ids, memory=m(ids).memory, cache=m.new_cache())
    with pytest.raises(ValueError, match="batch, tokens"):
        m(ids[0])
    with pytest.raises(ValueError, match="integer token ids"):
        m(ids.float())
    with pytest.raises(ValueError, match="targets_BT must have the shape of ids_BT"):
        m(ids, ids[:, :7])
    with pytest.raises(ValueError, match="valid_BT must have the shape of ids_BT"):
        m(ids, valid_BT=torch.ones(1, 7, dtype=torch.bool))
    two = torch.randint(0, 50, (2, 8))
    with pytest.raises(ValueError, match="same batch rows"):
        m(two, memory=m(ids).memory)  # memory of a batch of 1


def _train_step_grads(m, ids, tgt, mem, valid, seed, **kw):
    m.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = m(ids, tgt, memory=mem, valid_BT=valid, **kw)
    out.total_loss.backward()
    return out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention", ["dense", "switchhead"])
@pytest.mark.parametrize("tied", [False, True])
def test_training_fast_paths_equal_the_reference_loss_and_gradients(attention, tied,
                                                                    monkeypatch):
    # What training runs (return_logits=False: the fused output layer + cross-entropy; the
    # mask-keeping dropouts) against the reference path (logits, then the loss; torch's own
    # dropout), float32 in training mode with dropout and padding: same loss, same gradients.
    from moeify.layers.common import Dropout
    from moeify.layers.feedforward import DenseFeedForward

    cfg = dataclasses.replace(small(attention=attention), dropout=0.3, tie_embeddings=tied,
                              output_bias=not tied,
                              feedforward=dense_ff(d=32, L=2, d_ff=64, dropout=0.3))
    m = model_of(cfg, dtype=torch.float32).train()
    g = torch.Generator().manual_seed(0)
    ids, tgt = torch.randint(0, 50, (3, 8), generator=g), torch.randint(0, 50, (3, 8), generator=g)
    mem = [torch.randn(3, 8, 32, generator=g) for _ in range(2)]
    valid = torch.rand(3, 8, generator=g) > 0.2
    fast, fast_grads = _train_step_grads(m, ids, tgt, mem, valid, 5, return_logits=False)
    assert fast.logits is None and "Fused" in type(fast.loss.grad_fn).__name__
    monkeypatch.setattr(Dropout, "impl", "reference")
    monkeypatch.setattr(DenseFeedForward, "dropout_impl", "reference")
    ref, ref_grads = _train_step_grads(m, ids, tgt, mem, valid, 5)
    assert ref.logits.shape == (3, 8, 50)
    torch.testing.assert_close(fast.loss, ref.loss, rtol=1e-6, atol=1e-6)
    assert fast_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(fast_grads[name], ref_grads[name], rtol=1e-5, atol=1e-6,
                                   msg=name)
    # dropout really acted: another seed gives another loss
    other, _ = _train_step_grads(m, ids, tgt, mem, valid, 6)
    assert not torch.equal(other.loss, ref.loss)


def test_return_logits_false_without_gradients_or_targets():
    m = model_of(small(), dtype=torch.float32)
    ids = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        out = m(ids, ids, return_logits=False)
    assert out.logits is None
    torch.testing.assert_close(out.loss, m(ids, ids).loss)
    assert m(ids, return_logits=False).logits.shape == (2, 8, 50)  # nothing to fuse with
