"""Hugging Face checkpoints in and out (moeify.interop): tiny GPT-2 / Llama-family checkpoints
written here by transformers with random weights are imported and compared logit for logit;
every moeify family is exported and loaded back by transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="needs the hf extra: "
                                   "pip install 'moeify[hf]'")

from moeify.cli.main import main  # noqa: E402
from moeify.data.tokenizers import ByteTokenizer  # noqa: E402
from moeify.interop import export_hf, import_hf  # noqa: E402
from moeify.interop.hf_export import byte_level_tokenizer_json  # noqa: E402
from moeify.models.cost import model_parameters  # noqa: E402
from moeify.train.rundir import load_trained  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
V = 300  # model vocabulary; the byte-level test tokenizer has 256 ids (padded rows beyond)
MAX_DIFF: dict[str, float] = {}  # measured differences, printed at the end of the module


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights far from transformers' tiny default init, so that every term shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.15 if p.dim() > 1 else 1.0 + 0.1 * noise)


HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0),
    "llama-gqa-untied": lambda: transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "llama-tied-bias": lambda: transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True),
}


def make_hf_checkpoint(root: Path, name: str, seed: int = 0):
    """A save_pretrained directory with random weights and a byte-level tokenizer.json."""
    torch.manual_seed(seed)
    cfg = HF_CONFIGS[name]()
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    _randomise(model, seed)
    model.eval()
    path = root / name
    model.save_pretrained(path)
    (path / "tokenizer.json").write_bytes(byte_level_tokenizer_json(range(256), unk=False))
    return model, path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: make_hf_checkpoint(root, name, seed=i) for i, name in enumerate(HF_CONFIGS)}


@pytest.fixture(scope="module")
def imported(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {name: import_hf(path, root / name) for name, (_, path) in hf_dirs.items()}


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # the second row is right-padded
    return ids, mask


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_imported_logits_equal_transformers(name, hf_dirs, imported):
    hf_model, _ = hf_dirs[name]
    tm = load_trained(imported[name])
    ids, mask = _batch()
    with torch.no_grad():
        want = hf_model(ids, attention_mask=mask).logits
        got = tm.model(ids, valid_BT=mask.bool()).logits
        full_want = hf_model(ids[:1]).logits
        full_got = tm.model(ids[:1]).logits
    valid = mask.bool()
    diff = max((got - want)[valid].abs().max().item(), (full_got - full_want).abs().max().item())
    MAX_DIFF[f"import {name}"] = diff
    assert want.abs().max() > 1.0  # the comparison is not between two near-zero tensors
    assert diff < 1e-4, diff


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied"])
def test_imported_cached_decoding_equals_full_forward(name, imported):
    model = load_trained(imported[name]).model
    ids, _ = _batch(2)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        pieces = [model(ids[:, :5], cache=cache).logits]
        pieces += [model(ids[:, t:t + 1], cache=cache).logits for t in range(5, 12)]
    assert (torch.cat(pieces, 1) - full).abs().max() < 1e-5


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_count_prices_imported_models_exactly(name, hf_dirs, imported):
    hf_model, _ = hf_dirs[name]
    cfg = load_trained(imported[name]).model_config
    assert model_parameters(cfg)["total"] == hf_model.num_parameters()


def test_imported_run_files(imported):
    run = imported["gpt2"]
    model_json = json.loads((run / "model.json").read_text())
    assert model_json["tie_embeddings"] is True and model_json["max_positions"] == 64
    assert json.loads((run / "config.json").read_text())["preset"] == "run-model"
    tok = load_trained(run).tokenizer
    assert tok.name == "hf" and tok.vocab_size == V
    assert tok.decode(tok.encode("Hello, world")) == "Hello, world"


def test_report_measured_differences():
    """Prints the largest logit differences measured above (pytest -s shows them)."""
    print("\nmax |logit difference|:", json.dumps({k: f"{v:.2e}" for k, v in MAX_DIFF.items()}))
    assert all(v < 1e-4 for v in MAX_DIFF.values())
