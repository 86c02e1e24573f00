"""``moeify generate`` ends where transformers' generate ends: at the model's end-of-sequence
token (greedy decoding of the same tiny Llama, imported), at a --stop string, and runs to
--max-new-tokens with --no-eos."""

from __future__ import annotations

import json

import pytest
import torch

from hf_checkpoints import hf_transformers, save_checkpoint

transformers = hf_transformers()

from moeify.cli.main import main  # noqa: E402
from moeify.interop import import_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPT = "abc"


def greedy(model, ids, n, **kw):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def llama_with_eos(tmp_path_factory):
    """A tiny Llama whose end-of-sequence id is the 4th token of its greedy continuation of
    PROMPT: transformers' generate stops after 4 tokens."""
    root = tmp_path_factory.mktemp("eos")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model, _ = save_checkpoint(cfg, root, "probe", seed=3)
    ids = list(PROMPT.encode())
    free = greedy(model, ids, 12, eos_token_id=None)
    eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    cfg.eos_token_id = eos
    model, src = save_checkpoint(cfg, root, "llama", seed=3)
    run = import_hf(src, root / "run")
    return model, ids, free, eos, run


def run_generate(run, *extra):
    return ["generate", "--run", str(run), "--prompt", PROMPT, "--temperature", "0",
            "--max-new-tokens", "12", *extra]


def _text(tokens):
    """What the byte-level tokenizer prints for byte ids (GPT-2's byte-to-character map)."""
    from tokenizers import Tokenizer

    from moeify.interop.hf_export import byte_level_tokenizer_json

    tok = Tokenizer.from_str(byte_level_tokenizer_json(range(256), unk=False).decode())
    return tok.decode(tokens)


def test_generate_cli_eos_stop_and_no_eos(llama_with_eos, capsys):
    model, ids, free, eos, run = llama_with_eos
    theirs = greedy(model, ids, 12)  # generation_config.eos_token_id from config.json
    assert theirs[-1] == eos and len(theirs) < 12 and theirs == free[:len(theirs)]
    assert main(run_generate(run)) == 0
    assert capsys.readouterr().out == PROMPT + _text(theirs[:-1]) + "\n"
    assert main(run_generate(run, "--no-eos")) == 0
    assert capsys.readouterr().out == PROMPT + _text(free) + "\n"
    stop = _text(free[1:2])
    assert stop not in _text(free[:1])
    assert main(run_generate(run, "--no-eos", "--stop", stop)) == 0
    assert capsys.readouterr().out == PROMPT + _text(free[:2]) + "\n"
    assert json.loads((run / "hf_config.json").read_text())["eos_token_id"] == eos
