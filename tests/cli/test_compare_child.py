"""A compare / sweep child stopped part-way. Stopped by a signal while training, it writes no
result for the half-trained model, and the next attempt resumes from the checkpoint of the step
it finished. Stopped while scoring a finished training, the next attempt scores it without
training it again, with the training time recorded when the training finished."""

from __future__ import annotations

import json
import os
import signal
import types

import pytest

from moeify.sweep import child as sweep_child
from moeify.sweep import protocol, scheduler
from moeify.rundir.layout import latest_checkpoint, step_of
from moeify.train.config import TrainConfig
from moeify.train.trainer import Trainer

STEPS = 3


@pytest.fixture
def child(text_corpus):
    """(run_dir, spec) of a tiny run, not yet planned."""
    cfg = TrainConfig(preset="tiny-dense", data=str(text_corpus / "corpus.txt"), steps=STEPS,
                      seed=0).with_overrides(
        ["tokenizer=byte", "batch_size=2", "model.d_model=32", "model.n_layers=2",
         "model.context_length=16", "eval_every=1", "eval_tokens=64", "log_every=1",
         "checkpoint_every=1"])
    run_dir = text_corpus / "run"
    spec = {"name": "tiny-dense", "preset": "tiny-dense", "train_config": cfg.to_dict(),
            "run_dir": str(run_dir), "threads": 1, "final_eval_tokens": 128,
            "blimp_per_paradigm": 0, "blimp_data": None}
    return run_dir, spec


def _plan_and_write(run_dir, spec):
    """What the scheduler does before starting a child: plan the directory, write the spec."""
    assert scheduler.plan_run(run_dir, spec, reuse=True) is None
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / protocol.SPEC_FILE
    path.write_text(json.dumps(spec))
    return str(path)


def _trained_steps(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["step"] for x in lines if x.startswith('{"kind": "train"')]


def test_a_signal_while_training_leaves_no_result_and_the_run_resumes(child, monkeypatch):
    run_dir, spec = child
    one_step = Trainer._one_step

    def step_then_sigterm(self, *args, **kwargs):
        one_step(self, *args, **kwargs)
        if self.step == 1:  # what the scheduler's stop() sends a running child
            # Only with the trainer's handler installed: the default action would end pytest.
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Trainer, "_one_step", step_then_sigterm)
    assert sweep_child.child_main(_plan_and_write(run_dir, spec)) == 128 + signal.SIGTERM
    assert not (run_dir / protocol.CHILD_RESULT).exists()  # a half-trained model is no result
    assert step_of(latest_checkpoint(run_dir)) == 1
    monkeypatch.setattr(Trainer, "_one_step", one_step)

    path = _plan_and_write(run_dir, spec)
    assert spec["resume"] is True
    assert sweep_child.child_main(path) == 0
    assert _trained_steps(run_dir) == list(range(1, STEPS + 1))  # each step once
    result = json.loads((run_dir / protocol.CHILD_RESULT).read_text())
    assert result["final_valid"]["tokens"] > 0


def test_a_stop_while_scoring_resumes_at_the_scoring(child, monkeypatch):
    run_dir, spec = child
    import moeify.eval.adapters as adapters

    spec["blimp_per_paradigm"] = 1  # no BLiMP data: the result says which flag gives it
    monkeypatch.delenv("MOEIFY_DATA_DIR", raising=False)

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt("stopped while scoring")

    with monkeypatch.context() as mp:
        mp.setattr(adapters, "evaluate_stream", stopped)
        with pytest.raises(KeyboardInterrupt):
            sweep_child.child_main(_plan_and_write(run_dir, spec))
    assert not (run_dir / protocol.CHILD_RESULT).exists()
    assert step_of(latest_checkpoint(run_dir)) == STEPS
    recorded = json.loads((run_dir / protocol.CHILD_TRAINED).read_text())
    assert recorded["train_wall_s"] > 0 and recorded["trainer_tokens_per_s"] > 0
    assert recorded["max_rss_bytes"] > 50 * 2 ** 20  # the training process, torch loaded

    path = _plan_and_write(run_dir, spec)
    assert spec["resume"] is True
    assert sweep_child.child_main(path) == 0  # not "already trained 3 steps: nothing to do"
    assert _trained_steps(run_dir) == list(range(1, STEPS + 1))  # not trained again
    result = json.loads((run_dir / protocol.CHILD_RESULT).read_text())
    assert result["train_wall_s"] == recorded["train_wall_s"]
    assert result["trainer_tokens_per_s"] == recorded["trainer_tokens_per_s"]
    assert result["max_rss_bytes"] == recorded["max_rss_bytes"]  # the training's, not scoring's
    assert "pass its path (--blimp-data PATH)" in result["blimp"]["error"]  # compare's flag


def test_the_scheduler_reports_a_stopped_child_as_resumable(tmp_path):
    from moeify.errors import MoeifyError

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / protocol.CHILD_LOG).write_text("stopped by SIGTERM after step 1 of 3\n")
    spec = {"name": "tiny-dense", "run_dir": str(run_dir)}
    sched = scheduler.Scheduler([], jobs=1)
    for code, says in ((128 + signal.SIGTERM, "run the same command again to resume"),
                       (1, r"failed \(exit 1\)")):
        sched.running[4242] = (types.SimpleNamespace(), spec, 0.0)  # _reap sets returncode
        with pytest.raises(MoeifyError, match=says):
            sched._reap(4242, code << 8, None)  # a wait status: exit code in the high byte


def test_the_eta_counts_a_run_still_at_step_0(tmp_path):
    """A finished run gives the seconds per step; a running child that has logged nothing yet
    is then estimated from it, not counted as done (the line said "ETA 0m00s")."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sched = scheduler.Scheduler([], jobs=1)
    assert sched._eta() == "ETA unknown"
    sched.running[4242] = (types.SimpleNamespace(), {"name": "b", "run_dir": str(run_dir),
                                                     "train_config": {"steps": 100}}, 0.0)
    assert sched._eta() == "ETA unknown"  # nothing has a rate yet
    sched.durations.append((120.0, 100))  # the first run: 1.2 s per step
    assert sched._eta() == "ETA 2m00s"
