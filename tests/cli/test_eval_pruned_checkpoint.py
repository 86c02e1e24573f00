"""`eval` of a sharded run whose training prunes the checkpoint being read: the reader
(moeify.rundir.model.load_trained) reads the run's new latest, or, when the checkpoint was named
itself, says in one line what happened. The pruning is made deterministic: a hook deletes the
checkpoint directory after it was verified and before its DCP files are read."""

from __future__ import annotations

import json
import shutil

import pytest

from moeify.cli.main import main
from moeify.rundir import checkpoints

SETTINGS = ("tokenizer=byte256", "model.d_model=16", "model.n_layers=1",
            "model.context_length=16", "batch_size=2", "eval_every=0", "eval_tokens=64",
            "checkpoint_every=1", "keep_checkpoints=2", "parallel=fsdp")


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A one-process parallel=fsdp run (sharded checkpoints) with steps 1 and 2 kept."""
    tmp = tmp_path_factory.mktemp("pruned")
    corpus = tmp / "corpus.txt"
    corpus.write_text("the cat sat on the mat by the door.\n" * 100)
    run = tmp / "run"
    assert main(["train", "--preset", "tiny-switchall", "--data", str(corpus), "--steps", "2",
                 "--out", str(run), *[a for x in SETTINGS for a in ("--set", x)],
                 "--quiet"]) == 0
    steps = sorted(p.name for p in run.glob("checkpoints/step-*"))
    assert steps == ["step-00000001", "step-00000002"] and list(run.glob("**/dcp"))
    return run, corpus


def _live_run(sharded_run, tmp_path, monkeypatch):
    """A copy of the run whose `latest` names step 1; reading step 1 prunes it mid-read, as the
    trainer does when it publishes step 2 (latest moved first, then the old one removed)."""
    run = tmp_path / "run"
    shutil.copytree(sharded_run[0], run)
    root = run / "checkpoints"
    (root / "latest").write_text("step-00000001\n")
    verify = checkpoints.verify_sharded
    pruned = []

    def verify_then_prune(ckpt, **kw):
        meta = verify(ckpt, **kw)
        if ckpt.name == "step-00000001":
            (root / "latest").write_text("step-00000002\n")
            shutil.rmtree(ckpt)
            pruned.append(ckpt.name)
        return meta

    monkeypatch.setattr(checkpoints, "verify_sharded", verify_then_prune)
    return run, pruned


def test_eval_of_a_run_reads_the_new_latest_when_its_checkpoint_is_pruned_mid_read(
        sharded_run, tmp_path, monkeypatch, capsys):
    run, pruned = _live_run(sharded_run, tmp_path, monkeypatch)
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--task", "ppl", "--data", str(sharded_run[1]),
                 "--limit", "32", "--device", "cpu", "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert pruned == ["step-00000001"]
    assert (result["checkpoint"], result["step"]) == ("step-00000002", 2)


def test_a_named_checkpoint_pruned_mid_read_is_one_line_naming_the_run(
        sharded_run, tmp_path, monkeypatch, capsys):
    run, pruned = _live_run(sharded_run, tmp_path, monkeypatch)
    capsys.readouterr()
    ckpt = run / "checkpoints" / "step-00000001"
    assert main(["eval", "--run", str(ckpt), "--task", "ppl", "--data", str(sharded_run[1]),
                 "--limit", "32", "--device", "cpu", "--quiet"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert pruned == ["step-00000001"] and len(err) == 1, err
    assert err[0] == (f"moeify eval: error: checkpoint {ckpt} was removed while it was being "
                      "read (its training run pruned it, keeping only its newest checkpoints); "
                      f"give the run directory {run} to read its newest checkpoint")
    assert "model" not in err[0].split("(")[0]  # the model is not blamed
