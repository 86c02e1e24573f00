"""Checkpoints: round trip, atomicity under a failed write, pruning, corruption and mismatch
detection."""

import json
import os

import pytest
import torch

from moeify.errors import MoeifyError
from moeify.rundir import atomic, layout
from moeify.rundir import checkpoints as ckr
from moeify.rundir import write as ck


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}
    train = {"step": seed, "optimizer": {"state": {0: {"exp_avg": torch.randn(2, generator=g)}},
                                         "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
             "rng": [{"torch": torch.get_rng_state()}], "memory": [torch.randn(2, 3, 4)]}
    return model, train


def _save(run, step, keep=2, meta=None):
    model, train = _state(step)
    return ck.save_checkpoint(run, step, model, train, meta=meta or {"model_config": {"d": 1}},
                              keep=keep), model, train


def test_round_trip_restores_every_tensor_and_value(tmp_path):
    path, model, train = _save(tmp_path, 7)
    got = ckr.load_checkpoint(tmp_path, model_config={"d": 1})
    assert got.path == path and got.step == 7
    assert set(got.model_state) == {"w", "b"}
    for k in model:
        assert torch.equal(got.model_state[k], model[k])
    st = got.train_state
    assert torch.equal(st["optimizer"]["state"][0]["exp_avg"], train["optimizer"]["state"][0]["exp_avg"])
    assert st["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert torch.equal(st["memory"][0], train["memory"][0])
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000007"


def test_failed_write_keeps_previous_checkpoint_and_pointer(tmp_path, monkeypatch):
    good, model, _ = _save(tmp_path, 2)
    good_files = {f: (good / f).read_bytes() for f in os.listdir(good)}

    def dies_midway(state, path):
        path.write_bytes(b"\x80\x02partial")  # what a killed process leaves behind
        raise OSError("No space left on device")

    monkeypatch.setattr(ck, "save_state", dies_midway)
    with pytest.raises(OSError):
        _save(tmp_path, 4)
    root = tmp_path / "checkpoints"
    assert [p.name for p in layout.checkpoint_dirs(tmp_path)] == ["step-00000002"]
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())  # removed at once
    assert layout.latest_checkpoint(tmp_path) == good
    assert {f: (good / f).read_bytes() for f in os.listdir(good)} == good_files
    got = ckr.load_checkpoint(tmp_path)
    assert got.step == 2 and torch.equal(got.model_state["w"], model["w"])

    monkeypatch.undo()
    (root / ".tmp-step-00000003-999999999").mkdir()  # debris of a killed process
    _save(tmp_path, 4)  # the next successful save clears the leftover
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    assert ckr.load_checkpoint(tmp_path).step == 4


def test_keep_prunes_oldest_and_abandoned_newer_checkpoints(tmp_path):
    for s in (1, 2, 3, 4):
        _save(tmp_path, s, keep=2)
    assert [p.name for p in layout.checkpoint_dirs(tmp_path)] == ["step-00000003", "step-00000004"]
    # Resumed from step 3 and saved step 3 again: step 4 belongs to the abandoned continuation.
    _save(tmp_path, 3, keep=3)
    assert [p.name for p in layout.checkpoint_dirs(tmp_path)] == ["step-00000003"]


def test_latest_falls_back_to_newest_complete_dir(tmp_path):
    _save(tmp_path, 1)
    path, _, _ = _save(tmp_path, 2)
    (tmp_path / "checkpoints" / "latest").unlink()
    assert layout.latest_checkpoint(tmp_path) == path
    (tmp_path / "checkpoints" / "step-00000009").mkdir()  # no meta.json: incomplete
    assert layout.latest_checkpoint(tmp_path) == path


@pytest.mark.parametrize("victim", ["model.safetensors", "state.pt"])
def test_flipped_byte_is_reported_as_corrupt(tmp_path, victim):
    path, _, _ = _save(tmp_path, 3)
    data = bytearray((path / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / victim).write_bytes(bytes(data))
    with pytest.raises(MoeifyError, match=f"corrupt: {victim}"):
        ckr.load_checkpoint(path)


def test_truncated_files_without_checksums_are_reported(tmp_path):
    path, _, _ = _save(tmp_path, 3)
    meta = json.loads((path / "meta.json").read_text())
    meta["sha256"] = {}
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(MoeifyError, match="model.safetensors cannot be read"):
        ckr.load_checkpoint(path)
    (path / "meta.json").write_text("{not json")
    with pytest.raises(MoeifyError, match="meta.json cannot be read"):
        ckr.load_checkpoint(path)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    _save(tmp_path, 1, meta={"preset": "tiny-dense", "model_config": {"d": 1, "L": 2}})
    with pytest.raises(MoeifyError, match="another model.*tiny-dense.*L 2 in the checkpoint vs 4"):
        ckr.load_checkpoint(tmp_path, model_config={"d": 1, "L": 4})


def test_missing_paths_and_empty_runs(tmp_path):
    with pytest.raises(FileNotFoundError):
        ckr.load_checkpoint(tmp_path / "nope")
    with pytest.raises(MoeifyError, match="no complete checkpoint"):
        ckr.load_checkpoint(tmp_path)


def test_load_model_state_mismatch_is_a_clear_error(tmp_path):
    _save(tmp_path, 1)
    got = ckr.load_checkpoint(tmp_path)
    with pytest.raises(MoeifyError, match="does not fit this model"):
        ckr.load_model_state(torch.nn.Linear(4, 3), got)


def test_write_bytes_atomic_leaves_old_content_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "f.json"
    atomic.write_bytes_atomic(target, b"old")

    def boom(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(ck.os, "replace", boom)
    with pytest.raises(OSError):
        atomic.write_bytes_atomic(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]
