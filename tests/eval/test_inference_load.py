"""Inference loads weights only: ``load_trained`` (generate, eval, export) never unpickles a
checkpoint's optimizer state, maps the weights from model.safetensors instead of copying them,
and keeps their dtype; a checkpoint damaged on disk is still refused."""

from __future__ import annotations

import torch

from moeify.data.tokenizers import ByteTokenizer
from moeify.rundir import load_trained
from moeify.rundir.files import model_config_dict, write_run_files
from moeify.rundir.write import save_checkpoint
from moeify.train.config import TrainConfig, resolve_model_config


def _run(root, dtype=torch.float32):
    cfg = TrainConfig(preset="tiny-dense", model_overrides=("model.n_layers=1",
                                                            "model.context_length=16"),
                      tokenizer="byte256")
    model_cfg = resolve_model_config(cfg, 256)
    torch.manual_seed(0)
    model = model_cfg.build()
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    optimizer = {"optimizer": {"state": {0: {"exp_avg": torch.ones(1000)}}}, "step": 1}
    write_run_files(root, cfg, model_cfg, ByteTokenizer())
    save_checkpoint(root, 1, state, optimizer,
                    meta={"preset": cfg.preset, "model_config": model_config_dict(model_cfg)})
    return state


def test_inference_never_unpickles_the_optimizer_state(tmp_path, monkeypatch):
    state = _run(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load called: the optimizer state was read")

    monkeypatch.setattr(torch, "load", refuse)
    tm = load_trained(tmp_path)
    assert tm.checkpoint.train_state == {}
    got = tm.model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_weights_are_mapped_from_the_file_in_their_dtype(tmp_path):
    state = _run(tmp_path, torch.bfloat16)
    tm = load_trained(tmp_path)
    params = dict(tm.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert all(torch.equal(params[k], state[k]) for k in params)
    # One mapping of the file holds every weight: their storages are that one buffer.
    storages = {p.untyped_storage().data_ptr() for p in params.values()}
    assert len(storages) == 1
    with torch.no_grad():
        logits = tm.model(torch.arange(8)[None]).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_a_damaged_weights_file_is_still_refused(tmp_path):
    import pytest

    from moeify.errors import MoeifyError

    _run(tmp_path)
    weights = next(tmp_path.glob("checkpoints/step-*/model.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(MoeifyError, match="does not match the checksum"):
        load_trained(tmp_path)
