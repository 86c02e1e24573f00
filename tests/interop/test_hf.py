"""Hugging Face checkpoints in and out (moeify.interop): tiny GPT-2 / Llama-family checkpoints
written here by transformers with random weights are imported and compared logit for logit;
every moeify family is exported and loaded back by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_checkpoints import (cached_decoding_diff, hf_transformers, imported_logit_diff,
                            padded_batch, random_run)

transformers = hf_transformers()

from moeify.cli.main import main  # noqa: E402
from moeify.data.tokenizers import ByteTokenizer  # noqa: E402
from moeify.interop import export_hf, import_hf  # noqa: E402
from moeify.models.params import model_parameters  # noqa: E402
from moeify.rundir import load_trained  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
V = 300  # model vocabulary; the byte-level test tokenizer has 256 ids (padded rows beyond)
MAX_DIFF: dict[str, float] = {}  # measured differences, printed at the end of the module




HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
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


def _batch(seed: int = 1):
    return padded_batch(V, seed)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_imported_logits_equal_transformers(name, hf_dirs, imported):
    diff = imported_logit_diff(hf_dirs[name][0], load_trained(imported[name]).model, V)
    MAX_DIFF[f"import {name}"] = diff
    assert diff < 1e-4, diff


def test_sharded_checkpoint_imports(hf_dirs, tmp_path):
    hf_model, src = hf_dirs["llama-gqa-untied"]
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    (sharded / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    model = load_trained(import_hf(sharded, tmp_path / "run")).model
    ids, _ = _batch(6)
    with torch.no_grad():
        assert (model(ids).logits - hf_model(ids).logits).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied"])
def test_imported_cached_decoding_equals_full_forward(name, imported):
    assert cached_decoding_diff(load_trained(imported[name]).model, V) < 1e-5


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_count_prices_imported_models_exactly(name, hf_dirs, imported, capsys):
    hf_model, _ = hf_dirs[name]
    cfg = load_trained(imported[name]).model_config
    assert model_parameters(cfg)["total"] == hf_model.num_parameters()
    assert main(["count", "--run", str(imported[name]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == hf_model.num_parameters()


def test_imported_run_files(imported):
    run = imported["gpt2"]
    model_json = json.loads((run / "model.json").read_text())
    assert model_json["tie_embeddings"] is True and model_json["max_positions"] == 64
    assert json.loads((run / "config.json").read_text())["preset"] == "run-model"
    tok = load_trained(run).tokenizer
    assert tok.name == "hf" and tok.vocab_size == V
    assert tok.decode(tok.encode("Hello, world")) == "Hello, world"


def test_train_resume_continues_an_imported_model(hf_dirs, tmp_path, monkeypatch, capsys):
    """train --resume starts from the imported weights (step 0: fresh optimizer, any data)."""
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    run = import_hf(hf_dirs["llama-gqa-untied"][1], tmp_path / "run")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i} of a small corpus about cats and mats" for i in
                              range(400)))
    before = load_trained(run).model.state_dict()
    assert main(["train", "--resume", str(run), "--data", str(text), "--steps", "2",
                 "--set", "batch_size=2", "--set", "eval_every=0", "--set", "eval_tokens=128",
                 "--quiet"]) == 0
    after = load_trained(run)
    assert after.checkpoint.step == 2
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["data"] == str(text)
    # Fine-tuning defaults, not the tiny presets' lr 5e-3 (--set batch_size is kept): the
    # source's float32 as amp, a warm-up of 3% of the steps (at least 1), clipping 1.0.
    assert (cfg["lr"], cfg["warmup_steps"], cfg["grad_clip"], cfg["amp"],
            cfg["batch_size"]) == (5e-5, 1, 1.0, "fp32", 2)
    moved = [k for k, v in after.model.state_dict().items() if not torch.equal(v, before[k])]
    assert moved and max((after.model.state_dict()[k] - before[k]).abs().max() for k in moved) < 0.1
    assert main(["train", "--resume", str(run), "--data", "other", "--steps", "3"]) == 2
    assert "unknown corpus 'other'" in capsys.readouterr().err  # checked before training


# ---------------------------------------------------------------------- export

FAMILIES = ["tiny-dense", "tiny-switchhead", "tiny-moa", "tiny-sigmamoe", "tiny-switch",
            "tiny-mod", "tiny-switchall"]
SMALL = ("model.n_layers=2", "model.context_length=32")


def make_run(root: Path, preset: str, seed: int = 0) -> Path:
    """A run directory holding one checkpoint of a randomly initialised preset (byte256)."""
    return random_run(root, preset, seed, SMALL)


def load_exported(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    runs = {p: make_run(root, p, i) for i, p in enumerate(FAMILIES)}
    return {p: (run, export_hf(run, root / f"{p}-hf")) for p, run in runs.items()}


@pytest.mark.parametrize("preset", FAMILIES)
def test_exported_logits_and_greedy_generation_match_moeify(preset, exported):
    from moeify.eval.generate import generate

    run, out = exported[preset]
    assert json.loads((out / "config.json").read_text())["auto_map"]
    hf = load_exported(out)
    model = load_trained(run).model
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 20), generator=g)
    with torch.no_grad():
        want = model(ids).logits
        got = hf(ids, use_cache=False).logits
    diff = (got - want).abs().max().item()
    MAX_DIFF[f"export {preset}"] = diff
    assert diff < 1e-5, diff
    prompt = ids[0, :6].tolist()
    new = generate(model, prompt, max_new_tokens=10, temperature=0.0)
    out_ids = hf.generate(ids[:1, :6], max_new_tokens=10, do_sample=False)
    assert out_ids[0, 6:].tolist() == new


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-switchhead"])
def test_exported_cache_continues_the_sequence(preset, exported):
    """The cache transformers gets back is moeify's, and decoding with it equals the full
    forward pass; generate() hands it from step to step."""
    run, out = exported[preset]
    hf = load_exported(out)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = hf(ids, use_cache=False).logits
        first = hf(ids[:, :8])
        assert type(first.cache).__name__ == "MoeifyCache" and first.cache.get_seq_length() == 8
        steps = [first.logits]
        cache = first.cache
        for t in range(8, 12):
            step = hf(ids[:, t:t + 1], cache=cache)
            cache = step.cache
            steps.append(step.logits)
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5
    model = load_trained(run).model
    with torch.no_grad():
        want = model(ids[:, :-1], ids[:, 1:]).loss
        assert torch.allclose(hf(ids, labels=ids, use_cache=False).loss, want, atol=1e-6)
    gen = hf.generate(ids[:, :4], max_new_tokens=3, do_sample=False,
                      return_dict_in_generate=True)
    assert type(gen.cache).__name__ == "MoeifyCache"
    assert gen.cache.get_seq_length() == 4 + 3 - 1  # the last token is never fed back


def test_round_trip_import_export_keeps_logits(hf_dirs, imported, tmp_path):
    for name in ("gpt2", "llama-gqa-untied"):
        hf_model, _ = hf_dirs[name]
        back = load_exported(export_hf(imported[name], tmp_path / name))
        ids, mask = _batch(5)
        with torch.no_grad():
            want = hf_model(ids, attention_mask=mask).logits
            got = back(ids, attention_mask=mask, use_cache=False).logits
        diff = (got - want)[mask.bool()].abs().max().item()
        MAX_DIFF[f"round trip {name}"] = diff
        assert diff < 1e-4, diff
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path / name, trust_remote_code=True)
        assert tok.eos_token == "\u0120" and tok.eos_token_id == 32
        assert tok("Hello").input_ids == load_trained(imported[name]).tokenizer.encode("Hello")


def test_cli_import_generate_export(hf_dirs, tmp_path, capsys):
    """moeify import / generate / export end to end: greedy text of `moeify generate` equals
    transformers' greedy generate() of the original checkpoint."""
    hf_model, src = hf_dirs["gpt2"]
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["import", "--hf", str(src), "--out", str(run)]) == 0
    assert main(["generate", "--run", str(run), "--prompt", "The cat", "--temperature", "0",
                 "--max-new-tokens", "8"]) == 0
    text = capsys.readouterr().out.rstrip("\n").splitlines()[-1]
    tok = load_trained(run).tokenizer
    prompt = tok.encode("The cat")
    ids = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert text == "The cat" + tok.decode(ids[0, len(prompt):].tolist())
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "modeling_moeify.py").is_file()
    assert "moeify" in (out / "README.md").read_text()


def test_exported_tokenizers_encode_as_moeify(tmp_path):
    """tokenizer.json written for byte (with an unknown id), byte256 and GPT-2 BPE runs gives
    moeify's ids."""
    from tokenizers import Tokenizer

    from moeify.data.gpt2_bpe import GPT2Tokenizer, bytes_to_unicode
    from moeify.interop.hf_export import tokenizer_json

    b2u = bytes_to_unicode()
    encoder = {b2u[b]: i for i, b in enumerate(range(256))}
    encoder.update({"Ġt": 256, "Ġth": 257, "he": 258})
    (tmp_path / "encoder.json").write_text(json.dumps(encoder))
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\nĠ t\nĠt h\nh e\n")
    text = "the theme, then: ünïcode!\n  two  spaces"
    for tok in (ByteTokenizer(range(97, 123)), ByteTokenizer(),
                GPT2Tokenizer(tmp_path / "encoder.json", tmp_path / "vocab.bpe")):
        hf = Tokenizer.from_str(tokenizer_json(tok).decode())
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text), tok
        assert hf.get_vocab_size(with_added_tokens=True) == tok.vocab_size


# ---------------------------------------------------------------------- bad input

def _bigger_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str((path / "tokenizer.json").read_text())
    tok.add_tokens([f"<extra{i}>" for i in range(V)])  # 556 ids for a 300-token model
    (path / "tokenizer.json").write_text(tok.to_str())


BAD_INPUTS = {
    "no config.json": (lambda p: (p / "config.json").unlink(), "has no config.json"),
    "unsupported architecture": (
        lambda p: (p / "config.json").write_text(json.dumps(
            {"model_type": "bert", "architectures": ["BertForMaskedLM"]})),
        "GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
    "missing weights": (lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
    "truncated weights": (
        lambda p: (p / "model.safetensors").write_bytes(
            (p / "model.safetensors").read_bytes()[:5000]), "truncated or damaged"),
    "tokenizer larger than the vocabulary": (_bigger_tokenizer, "the tokenizer has 556 tokens"),
    "no tokenizer": (lambda p: (p / "tokenizer.json").unlink(), "has no tokenizer.json"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_checkpoints_fail_in_one_line_and_write_nothing(case, hf_dirs, tmp_path, capsys):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(hf_dirs["gpt2"][1], src)
    damage, message = BAD_INPUTS[case]
    damage(src)
    out = tmp_path / "run"
    assert main(["import", "--hf", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == [src]


def test_import_and_export_refuse_a_used_output(imported, tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("user data")
    assert main(["export", "--run", str(imported["gpt2"]), "--out", str(used)]) == 2
    assert main(["import", "--hf", str(tmp_path), "--out", str(used)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in used.iterdir()] == ["keep.txt"]


UPCYCLE_CASES = {  # the conversions; SwitchHead does not preserve the function (upcycle docs)
    "switch": ["--ff", "switch:E=2,k=1,router_scale=0"],
    "sigma-moe+mod": ["--ff", "sigma-moe:E=4,router_scale=0",
                      "--depth", "mod:blocks=1,capacity=1,router_scale=0"],
    "switchhead+switch": ["--attention", "switchhead:E=2,k=2", "--ff", "switch:E=2"],
}


@pytest.mark.parametrize("case", list(UPCYCLE_CASES))
def test_upcycle_an_imported_checkpoint_end_to_end(case, hf_dirs, tmp_path, monkeypatch):
    """A transformers GPT-2 -> moeify import -> moeify upcycle (exact conversions: the imported
    logits to 1e-5) -> train --resume (the loss falls) -> moeify export -> transformers gives
    moeify's logits."""
    exact = "--attention" not in UPCYCLE_CASES[case]
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    hf_model, src = hf_dirs["gpt2"]
    run, up, out = tmp_path / "run", tmp_path / "up", tmp_path / "hf"
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i} of a small corpus about cats and mats" for i in
                              range(400)))
    assert main(["import", "--hf", str(src), "--out", str(run)]) == 0
    assert main(["upcycle", "--run", str(run), "--out", str(up), *UPCYCLE_CASES[case],
                 "--data", str(text), "--set", "batch_size=4", "--set", "warmup_steps=0",
                 "--set", "lr=3e-3", "--set", "eval_every=0", "--set", "eval_tokens=256",
                 "--set", "eval_batch_size=2"]) == 0
    ids, mask = _batch(7)
    imported_model, upcycled = load_trained(run).model, load_trained(up)
    with torch.no_grad():
        want = imported_model(ids, valid_BT=mask.bool()).logits
        got = upcycled.model(ids, valid_BT=mask.bool()).logits
    assert type(upcycled.model.blocks[0].feedforward).__name__ in ("SwitchFeedForward",
                                                                    "SigmaMoE")
    if exact:
        assert ((got - hf_model(ids, attention_mask=mask).logits)[mask.bool()].abs().max()
                < 1e-4)
        diff = (got - want)[mask.bool()].abs().max().item()
        MAX_DIFF[f"upcycle {case}"] = diff
        assert diff < 1e-5, diff
    else:
        assert type(upcycled.model.blocks[0].attention).__name__ == "SwitchHeadAttention"

    train_ids = torch.tensor(upcycled.tokenizer.encode(text.read_text())[:4 * 33]).view(4, 33)

    def loss(model):
        with torch.no_grad():
            return model(train_ids[:, :-1], train_ids[:, 1:]).loss.item()

    before = loss(upcycled.model)
    assert main(["train", "--resume", str(up), "--steps", "6", "--quiet"]) == 0
    trained = load_trained(up)
    assert trained.checkpoint.step == 6
    assert loss(trained.model) < before - 0.1, (before, loss(trained.model))

    assert main(["export", "--run", str(up), "--out", str(out)]) == 0
    hf_back = load_exported(out)
    with torch.no_grad():
        diff = (hf_back(ids, use_cache=False).logits - trained.model(ids).logits).abs().max()
    MAX_DIFF[f"upcycle {case} export"] = diff.item()
    assert diff < 1e-5, diff


def test_upcycle_refuses_what_an_imported_llama_cannot_convert(imported, tmp_path, capsys):
    """SwiGLU MLPs and grouped-query attention: a one-line error naming why, nothing written."""
    run = imported["llama-gqa-untied"]
    for flag, spec, why in (("--ff", "switch:E=2", "a gated (SwiGLU) MLP"),
                            ("--attention", "switchhead:E=2", "grouped-query attention")):
        assert main(["upcycle", "--run", str(run), "--out", str(tmp_path / "up"), flag, spec,
                     "--no-validate"]) == 2
        err = capsys.readouterr().err.strip()
        assert why in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "up").exists()


def test_report_measured_differences():
    """Prints the largest logit differences measured above (pytest -s shows them)."""
    print("\nmax |logit difference|:", json.dumps({k: f"{v:.2e}" for k, v in MAX_DIFF.items()}))
    assert all(v < 1e-4 for v in MAX_DIFF.values())
