"""Llama 3.x and the other scaled RoPE checkpoints (rope_type llama3, linear, dynamic, yarn):
tiny random Llama models written here by transformers import with its logits (positions past
the original context, where the scaling matters), export back natively with the same
rope_parameters, and the scaled frequencies equal transformers' own."""

from __future__ import annotations

import json

import pytest
import torch

from hf_checkpoints import hf_transformers, save_checkpoint

transformers = hf_transformers()
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from moeify.interop import export_hf, import_hf  # noqa: E402
from moeify.interop.hf_mapping import rope_from_hf  # noqa: E402
from moeify.ops.positional import rope_attention_factor, scaled_rope_inv_freq  # noqa: E402
from moeify.rundir import load_trained  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
V = 256
# Llama 3.1's own scaling (factor 8, original context 8192) shrunk to a 16-token original
# context, so that a 40-token input spans every band of frequencies.
ROPE = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 8.0, "beta_slow": 1.0},
}
POSITIONS = {"dynamic": 24}  # dynamic scales beyond max_position_embeddings itself
T = 40


def hf_config(kind: str):
    return transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=POSITIONS.get(kind, 64), rms_norm_eps=1e-5,
        tie_word_embeddings=False, eos_token_id=3,
        rope_parameters={"rope_theta": 500.0, **ROPE[kind]})


@pytest.mark.parametrize("kind", list(ROPE))
def test_scaled_rope_imports_and_exports_exactly(kind, tmp_path):
    hf_model, src = save_checkpoint(hf_config(kind), tmp_path, kind)
    run = import_hf(src, tmp_path / "run")
    model_json = json.loads((run / "model.json").read_text())
    assert model_json["context_length"] == POSITIONS.get(kind, 64)  # the source's, no cap
    tm = load_trained(run)
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(ids).logits
        got = tm.model(ids).logits
        plain = hf_model.__class__(transformers.LlamaConfig(
            **{**hf_model.config.to_dict(), "rope_parameters": {"rope_type": "default",
                                                                "rope_theta": 500.0}}))
        plain.load_state_dict(hf_model.state_dict())
        unscaled = plain.eval()(ids).logits
    assert (want - unscaled)[0, -1].abs().max() > 1e-2  # the scaling shows in the logits
    assert (got - want).abs().max().item() < 1e-4

    out = export_hf(run, tmp_path / "native", format="native")
    config = json.loads((out / "config.json").read_text())
    for key, value in ROPE[kind].items():
        if key != "original_max_position_embeddings" or kind != "dynamic":
            assert config["rope_parameters"][key] == value, key
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        again = back(ids).logits
    assert torch.equal(again, want) or (again - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", ["llama3", "linear", "yarn"])
def test_scaled_inverse_frequencies_equal_transformers(kind):
    cfg = hf_config(kind)
    want, want_factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    base, _, scaling = rope_from_hf(cfg.to_dict())
    got = scaled_rope_inv_freq(16, base, scaling)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)


def test_dynamic_frequencies_follow_the_longest_position():
    cfg = hf_config("dynamic")
    base, _, scaling = rope_from_hf(cfg.to_dict())
    for seq_len in (10, 24, 40):
        want, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=seq_len)
        got = scaled_rope_inv_freq(16, base, scaling, pos=torch.arange(seq_len))
        torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)


def test_unknown_rope_type_is_refused_in_one_line():
    from moeify.errors import MoeifyError

    with pytest.raises(MoeifyError, match="RoPE scaling 'longrope'"):
        rope_from_hf({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})
