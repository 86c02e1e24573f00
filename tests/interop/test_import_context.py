"""moeify import takes the checkpoint's context (max_position_embeddings, no cap of its own) and
says when it is shorter: only a sliding window caps it."""

import json

import pytest
import torch

from hf_checkpoints import hf_transformers

transformers = hf_transformers()

from moeify.cli.main import main  # noqa: E402
from moeify.interop.hf_export import byte_level_tokenizer_json  # noqa: E402


@pytest.mark.parametrize("kind, positions, window", [("llama", 8192, None), ("llama", 64, None),
                                                     ("mistral", 8192, 256)])
def test_import_keeps_the_source_context(tmp_path, capsys, kind, positions, window):
    torch.manual_seed(0)
    Config, Model = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if kind == "llama"
                     else (transformers.MistralConfig, transformers.MistralForCausalLM))
    extra = {} if window is None else {"sliding_window": window}
    cfg = Config(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=2,
                 max_position_embeddings=positions, **extra)
    src = tmp_path / kind
    Model(cfg).save_pretrained(src)
    (src / "tokenizer.json").write_bytes(byte_level_tokenizer_json(range(256), unk=False))
    assert main(["import", "--hf", str(src), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    T = json.loads((tmp_path / "run" / "model.json").read_text())["context_length"]
    assert T == (window or positions)
    said = f"the checkpoint has {positions} positions; moeify trains and generates over {T}"
    assert (said in out) == (window is not None)
