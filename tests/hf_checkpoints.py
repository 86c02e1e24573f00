"""Tiny random Hugging Face checkpoints for the interop tests (tests/interop/): a
save_pretrained directory with weights far from transformers' default init and a byte-level
tokenizer.json, and a right-padded batch. Test modules import transformers through
``hf_transformers`` (offline, or the module skipped without the hf extra)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from moeify.interop.hf_export import byte_level_tokenizer_json


def hf_transformers():
    """transformers, with the Hugging Face libraries kept offline (nothing downloads), or the
    calling test module skipped where the hf extra is not installed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    return pytest.importorskip("transformers", reason="needs the hf extra: "
                               "pip install -e '.[hf]' in the checkout")


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights far from transformers' tiny default init (and routers far from uniform), so that
    every term, and every routing decision, shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.15 if p.dim() > 1 else 1.0 + 0.1 * noise)


def save_checkpoint(cfg, root: Path, name: str, seed: int = 0):
    """(model, path): a model of ``cfg`` with random weights saved under root/name, with a
    byte-level tokenizer.json whose end of text is "Ġ" (id 32)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomise(model, seed)
    model.eval()
    path = root / name
    model.save_pretrained(path)
    (path / "tokenizer.json").write_bytes(byte_level_tokenizer_json(range(256), unk=False))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "\u0120"}))
    return model, path


def padded_batch(vocab: int, seed: int = 1):
    """Two rows of 12 random ids below ``vocab``, the second right-padded after 8, and its
    attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    return ids, mask


def imported_logit_diff(hf_model, model, vocab: int) -> float:
    """The largest logit difference between a transformers model and the moeify model imported
    from it, over ``padded_batch`` (its valid tokens) and its first row unpadded; the logits are
    first checked to be far from zero, so that the comparison means something."""
    ids, mask = padded_batch(vocab)
    with torch.no_grad():
        want = hf_model(ids, attention_mask=mask).logits
        got = model(ids, valid_BT=mask.bool()).logits
        full = (model(ids[:1]).logits - hf_model(ids[:1]).logits).abs().max()
    assert want.abs().max() > 1.0
    return max((got - want)[mask.bool()].abs().max().item(), full.item())


def cached_decoding_diff(model, vocab: int) -> float:
    """The largest logit difference between the full forward pass of a moeify model over the
    rows of ``padded_batch(vocab, 2)`` and decoding them with its cache (5 tokens, then one by
    one)."""
    ids, _ = padded_batch(vocab, 2)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        pieces = [model(ids[:, :5], cache=cache).logits]
        pieces += [model(ids[:, t:t + 1], cache=cache).logits for t in range(5, ids.shape[1])]
    return (torch.cat(pieces, 1) - full).abs().max().item()


def random_run(root: Path, preset: str, seed: int = 0,
               overrides: tuple[str, ...] = ("model.n_layers=2", "model.context_length=32")
               ) -> Path:
    """A moeify run directory root/preset holding one checkpoint of a randomly initialised
    preset (byte256 tokenizer), for the export tests."""
    from moeify.data.tokenizers import ByteTokenizer
    from moeify.rundir.write import save_checkpoint as save_run_checkpoint
    from moeify.train.config import TrainConfig, resolve_model_config
    from moeify.rundir.files import model_config_dict, write_run_files

    cfg = TrainConfig(preset=preset, model_overrides=overrides, tokenizer="byte256")
    model_cfg = resolve_model_config(cfg, 256)
    torch.manual_seed(seed)
    model = model_cfg.build()
    run = root / preset
    write_run_files(run, cfg, model_cfg, ByteTokenizer())
    save_run_checkpoint(run, 1, model.state_dict(), {"step": 1},
                        meta={"preset": preset, "model_config": model_config_dict(model_cfg)})
    return run
