"""moeify import says when the run's context is shorter than the checkpoint's positions."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="needs the hf extra: "
                                   "pip install -e '.[hf]'")

from moeify.cli.main import main  # noqa: E402
from moeify.interop.hf_export import byte_level_tokenizer_json  # noqa: E402


@pytest.mark.parametrize("positions, said", [(4096, True), (64, False)])
def test_import_says_when_it_caps_the_context(tmp_path, capsys, positions, said):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   max_position_embeddings=positions)
    src = tmp_path / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(src)
    (src / "tokenizer.json").write_bytes(byte_level_tokenizer_json(range(256), unk=False))
    assert main(["import", "--hf", str(src), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    T = json.loads((tmp_path / "run" / "model.json").read_text())["context_length"]
    assert T == min(positions, 2048)
    assert (f"the checkpoint has {positions} positions; moeify trains and generates over "
            f"{T} tokens" in out) == said
