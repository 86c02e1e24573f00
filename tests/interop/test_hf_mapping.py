"""One Hugging Face mapping per family (moeify.interop.hf_mapping): every transform's two
directions are inverse, each family's links name every tensor of the moeify model exactly once,
each family's config.json rows read back what the native export writes (one hand-built model
per native type), import and the native export read the same tables, and importing moeify
leaves transformers' registries untouched."""

from __future__ import annotations

import pytest
import torch

from moeify.errors import MoeifyError
from moeify.interop import hf_import, hf_mapping, hf_native
from moeify.interop.hf_mapping import (ARCHITECTURES, CONFIG_KEYS, FORMS, Fixed, Link, from_hf,
                                       tensor_links, to_hf)


@pytest.mark.parametrize("form, shapes", [("same", [(3, 4)]), ("t", [(3, 4)]),
                                          ("cat_t", [(4, 5)] * 3), ("cat", [(5,)] * 3),
                                          ("stack_t", [(3, 4, 6)])])
def test_each_transform_inverts_the_other_direction(form, shapes):
    g = torch.Generator().manual_seed(0)
    ours = [torch.randn(s, generator=g) for s in shapes]
    link = Link(tuple(f"o{i}" for i in range(len(ours))), ("t",), form)
    theirs = to_hf(link, ours)
    back = from_hf(link, theirs)
    assert len(back) == len(ours) and all(torch.equal(a, b) for a, b in zip(back, ours))
    assert all(torch.equal(a, b) for a, b in zip(to_hf(link, back), theirs))
    assert form in FORMS


def _configs():
    from moeify.layers.gqa import GroupedQueryAttentionConfig
    from moeify.layers.mlp import GatedMLPConfig, MLPConfig
    from moeify.layers.norm import NormConfig
    from moeify.layers.switch_ff import SwitchFFConfig
    from moeify.models.config import ModelConfig

    D, L = 16, 2
    llama_attn = GroupedQueryAttentionConfig(d_model=D, n_heads=4, n_kv_heads=2, d_head=4,
                                             qkv_bias=True, out_bias=True, n_layers=L,
                                             qk_norm="head")
    swiglu = GatedMLPConfig(d_model=D, d_ff=24, n_layers=L, bias=True)
    shared = GatedMLPConfig(d_model=D, d_ff=8, n_layers=L)
    moe = SwitchFFConfig(d_model=D, d_ff=8, n_experts=3, k=2, dropless=True, gated=True,
                         activation="silu", renormalize=True, shared=shared, shared_gate=True)
    rms = NormConfig(kind="rmsnorm", eps=1e-6, bias=False)
    gpt2 = ModelConfig(vocab_size=40, d_model=D, n_layers=L, context_length=8,
                       attention=GroupedQueryAttentionConfig(
                           d_model=D, n_heads=4, n_kv_heads=4, d_head=4, pos="absolute",
                           qkv_bias=True, out_bias=True, n_layers=L),
                       feedforward=MLPConfig(d_model=D, d_ff=32, activation="gelu_tanh",
                                             bias=True, n_layers=L),
                       xl_memory=False, norm=NormConfig(kind="layernorm"), max_positions=8,
                       tie_embeddings=True, output_bias=False)
    return {"gpt2": gpt2,
            "llama": ModelConfig(vocab_size=40, d_model=D, n_layers=L, context_length=8,
                                 attention=llama_attn, feedforward=swiglu, xl_memory=False,
                                 norm=rms, tie_embeddings=False, output_bias=False),
            "qwen2_moe": ModelConfig(vocab_size=40, d_model=D, n_layers=L, context_length=8,
                                     attention=llama_attn, feedforward=(moe, swiglu),
                                     xl_memory=False, norm=rms, tie_embeddings=False,
                                     output_bias=False)}


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2_moe", "mixtral"])
def test_links_cover_the_model_once_and_the_round_trip_is_the_identity(kind):
    cfg = _configs()["qwen2_moe" if kind == "mixtral" else kind]
    torch.manual_seed(0)
    state = cfg.build().state_dict()
    links = tensor_links(kind, cfg)
    ours = [k for link in links for k in link.ours]
    theirs = [k for link in links for k in link.theirs]
    assert sorted(ours) == sorted(state) and len(set(theirs)) == len(theirs)
    exported = hf_native.native_state(kind, cfg, state)
    assert sorted(exported) == sorted(theirs)
    back = hf_import.state_from_hf(exported, {"model_type": kind}, cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def _native_configs():
    """One hand-built model per native type, each exactly that type."""
    from moeify.layers.attention_core import RopeScaling
    from moeify.layers.gqa import GroupedQueryAttentionConfig
    from moeify.layers.mlp import GatedMLPConfig
    from moeify.layers.norm import NormConfig
    from moeify.layers.switch_ff import SwitchFFConfig
    from moeify.models.config import ModelConfig

    D, L = 16, 2

    def gqa(**kw):
        return GroupedQueryAttentionConfig(**{**dict(d_model=D, n_heads=4, n_kv_heads=2, d_head=4,
                                                     n_layers=L, rope_base=500.0), **kw})

    def swiglu(d_ff=24, **kw):
        return GatedMLPConfig(d_model=D, d_ff=d_ff, n_layers=L, **kw)

    def switch(renormalize, shared=None):
        return SwitchFFConfig(d_model=D, d_ff=8, n_experts=3, k=2, dropless=True, gated=True,
                              activation="silu", renormalize=renormalize, shared=shared,
                              shared_gate=shared is not None, balance_coef=0.02, z_coef=0.0)

    def model(attn, ff, tie=False):
        return ModelConfig(vocab_size=40, d_model=D, n_layers=L, context_length=8,
                           attention=attn, feedforward=ff, xl_memory=False,
                           norm=NormConfig(kind="rmsnorm", eps=1e-5, bias=False),
                           tie_embeddings=tie, output_bias=False)

    llama3 = RopeScaling(kind="llama3", factor=8.0, original_context=4, low_freq_factor=1.0,
                         high_freq_factor=4.0)
    return {"gpt2": _configs()["gpt2"],
            "llama": model(gqa(qkv_bias=True, out_bias=True, rope_scaling=llama3),
                           swiglu(bias=True, activation="gelu_tanh")),
            "mistral": model(gqa(n_kv_heads=1), swiglu(), tie=True),
            "qwen2": model(gqa(qkv_bias=True), swiglu()),
            "mixtral": model(gqa(), (switch(True),) * 2),
            "qwen2_moe": model(gqa(qkv_bias=True), (swiglu(), switch(False, swiglu(8)))),
            "qwen3_moe": model(gqa(d_head=8, qk_norm="head", qk_norm_eps=1e-5),
                               (switch(True), swiglu()), tie=True),
            "olmoe": model(gqa(n_kv_heads=4, qk_norm="full", qk_norm_eps=1e-5),
                           (switch(False),) * 2)}


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_config_rows_read_back_what_the_native_export_writes(kind):
    """model -> config.json entries (export) -> model (import) is the identity, and again with
    the entries as the source config (what an imported run exports with)."""
    cfg = _native_configs()[kind]
    assert hf_native.native_type(cfg, {"model_type": kind}) == kind
    entries = hf_native.native_config(kind, cfg, None)
    assert entries["model_type"] == kind and entries["architectures"] == [ARCHITECTURES[kind]]
    assert all(key.theirs in entries for key in CONFIG_KEYS[kind])
    assert hf_import.model_config_from_hf(entries) == cfg
    assert hf_native.native_config(kind, hf_import.model_config_from_hf(entries),
                                   entries) == entries


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_config_rows_refuse_what_moeify_does_not_implement_in_one_line(kind):
    entries = hf_native.native_config(kind, _native_configs()[kind], None)
    cases = [({k: v for k, v in entries.items() if k != "vocab_size"}, "no 'vocab_size'")]
    for key in CONFIG_KEYS[kind]:
        if isinstance(key, Fixed) and key.variant is not None:
            other = 8.0 if key.value is None else (
                not key.value if isinstance(key.value, bool) else key.value + 0.5)
            cases.append(({**entries, key.theirs: other}, f"sets {key.theirs}="))
    act = "activation_function" if kind == "gpt2" else "hidden_act"
    cases.append(({**entries, act: "swish_v9"}, "'swish_v9' is not supported"))
    for hf, message in cases:
        with pytest.raises(MoeifyError) as e:
            hf_import.model_config_from_hf(hf)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_import_and_export_read_one_architecture_table():
    assert hf_import.SUPPORTED_ARCHITECTURES is hf_mapping.ARCHITECTURES
    assert not hasattr(hf_native, "ARCHITECTURE")
    for ours, theirs in hf_mapping.LLAMA_ACTIVATIONS:
        assert hf_mapping.activation_from_hf(hf_mapping.activation_to_hf(ours, False),
                                             False) == ours
    for ours, theirs in hf_mapping.GPT2_ACTIVATIONS:
        assert hf_mapping.activation_from_hf(theirs, True) == ours


def test_importing_moeify_leaves_transformers_registry_alone(monkeypatch):
    """transformers imported first (as a script that loads an exported directory does), then
    moeify's package init runs: it registers nothing with transformers."""
    import importlib

    import moeify

    cm = pytest.importorskip("transformers.conversion_mapping")
    calls = []
    monkeypatch.setattr(cm, "register_checkpoint_conversion_mapping",
                        lambda *a, **k: calls.append(a[0]))
    importlib.reload(moeify)
    assert calls == []
