"""A run works from any directory: it records its data as an absolute path with a content
fingerprint; resume, eval and plot find it from elsewhere; resume accepts any path to the same
content and says so when the content differs; runs that recorded a relative path still resume."""

import json
import shutil

import pytest
import torch

from moeify.cli.main import main
from moeify.train.config import TrainConfig
from moeify.train.trainer import train

TINY = ["--set", "tokenizer=byte256", "--set", "model.d_model=16", "--set", "model.n_layers=1",
        "--set", "model.context_length=16", "--set", "model.feedforward.d_ff=32",
        "--set", "batch_size=2", "--set", "warmup_steps=0", "--set", "eval_tokens=64",
        "--set", "eval_batch_size=2", "--quiet"]


@pytest.fixture
def places(tmp_path, monkeypatch):
    """(project directory holding corpus.txt, another directory); cwd is the project."""
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "corpus.txt").write_text("".join(f"line {i} of the little corpus, words.\n"
                                                for i in range(300)))
    monkeypatch.chdir(project)
    yield project, elsewhere
    torch.set_num_threads(threads)


def test_a_run_records_its_data_and_works_from_anywhere(places, monkeypatch, capsys):
    project, elsewhere = places
    assert main(["train", "--data", "corpus.txt", "--steps", "2", "--out", "runs/a",
                 *TINY]) == 0
    saved = json.loads((project / "runs/a/config.json").read_text())
    assert saved["data"] == str(project / "corpus.txt")  # absolute, not as typed
    assert len(saved["data_sha256"]) == 64
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    run = str(project / "runs/a")
    assert main(["eval", "--run", run, "--task", "ppl", "--limit", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 32
    assert main(["train", "--resume", run, "--steps", "3", "--schedule", "stretch",
                 "--quiet"]) == 0
    # The same content by another path (a copy, here a relative one) resumes; other content
    # is refused with the reason.
    shutil.copy(project / "corpus.txt", elsewhere / "copy.txt")
    assert main(["train", "--resume", run, "--steps", "4", "--schedule", "stretch",
                 "--data", "copy.txt", "--quiet"]) == 0
    assert json.loads((project / "runs/a/config.json").read_text())["data"] == str(
        elsewhere / "copy.txt")
    (elsewhere / "other.txt").write_text("different text\n" * 300)
    capsys.readouterr()
    assert main(["train", "--resume", run, "--steps", "5", "--schedule", "stretch",
                 "--data", "other.txt", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not the data this run was trained on: its content " \
        "differs" in err


def test_a_run_that_recorded_a_relative_path_still_resumes_from_elsewhere(places, monkeypatch,
                                                                          capsys):
    """Runs written before data paths were resolved: config.json holds "corpus.txt" as typed
    (relative to the directory the run was started in) and no fingerprint."""
    project, elsewhere = places
    cfg = TrainConfig(data="corpus.txt", steps=2).with_overrides(
        [a for a in TINY[1::2] if "=" in a])
    train(cfg, project / "runs" / "old", quiet=True)
    saved = json.loads((project / "runs/old/config.json").read_text())
    assert saved["data"] == "corpus.txt" and "data_sha256" not in saved
    monkeypatch.chdir(elsewhere)
    run = str(project / "runs/old")
    assert main(["eval", "--run", run, "--task", "ppl", "--limit", "32", "--json"]) == 0
    assert main(["train", "--resume", run, "--steps", "3", "--schedule", "stretch",
                 "--quiet"]) == 0
    # and by an absolute path to the same file (it was "cannot change data")
    assert main(["train", "--resume", run, "--steps", "4", "--schedule", "stretch",
                 "--data", str(project / "corpus.txt"), "--quiet"]) == 0
    capsys.readouterr()
    (project / "corpus.txt").rename(project / "moved.txt")  # a run that cannot find its data
    assert main(["eval", "--run", run, "--task", "ppl"]) == 2
    err = capsys.readouterr().err
    assert "which is not there any more" in err and "pass --data PATH" in err
