"""A resume that changes ``steps`` never silently re-stretches the learning-rate schedule: the
rate of every update, before and after the resume, is checked against the schedule chosen."""

import json
import math

import pytest

from moeify.train.config import TrainConfig
from moeify.train.metrics import read_metrics
from moeify.train.schedule import lr_factor
from moeify.train.trainer import train

TINY = ("model.d_model=16", "model.n_layers=1", "model.context_length=8",
        "model.feedforward.d_ff=32")
LR, W = 1e-2, 2


def cfg_of(corpus, steps, **kw):
    base = dict(data=str(corpus), tokenizer="byte256", steps=steps, batch_size=2, warmup_steps=W,
                lr=LR, log_every=1, eval_every=0, eval_tokens=64, eval_batch_size=2,
                checkpoint_every=3, model_overrides=TINY)
    base.update(kw)
    return TrainConfig(**base)


def lrs(run):
    """step (1-based) -> the learning rate that update used, from metrics.jsonl."""
    return {r["step"]: r["lr"] for r in read_metrics(run) if r["kind"] == "train"}


def planned(steps, s, cosine=None):
    """The rate of update s (1-based) under warm-up W and a cosine over ``steps``."""
    return LR * lr_factor(s - 1, warmup_steps=W, cosine_steps=cosine or steps - W)


def test_resume_with_new_steps_needs_a_choice_and_each_choice_gives_its_rates(env):
    tmp, corpus = env
    base = tmp / "base"
    train(cfg_of(corpus, 10), base, quiet=True, stop_after=6)  # interrupted at step 6 of 10

    import shutil

    def copy(name):
        shutil.copytree(base, tmp / name)
        return tmp / name

    # No choice: refused, saying what each would do, and the run is untouched.
    before = (base / "config.json").read_text()
    with pytest.raises(ValueError, match="--schedule keep .*--schedule extend .*--schedule "
                                         "stretch"):
        train(cfg_of(corpus, 14), copy("refused"), resume=True, quiet=True)
    assert (tmp / "refused" / "config.json").read_text() == before

    # keep: the original schedule, rate for rate; shortened to 8 it stops mid-decay.
    run = copy("keep")
    train(cfg_of(corpus, 8), run, resume=True, quiet=True, schedule="keep")
    got = lrs(run)
    assert sorted(got) == list(range(1, 9))
    for s in got:
        assert got[s] == pytest.approx(planned(10, s), rel=1e-12, abs=0), s

    # extend: the rates of steps 1-6 stay; from step 7 a cosine from the rate step 7 had
    # down to 0 at step 14.
    run = copy("extend")
    train(cfg_of(corpus, 14), run, resume=True, quiet=True, schedule="extend")
    got, f0 = lrs(run), planned(10, 7) / LR
    assert sorted(got) == list(range(1, 15))
    for s in got:
        want = planned(10, s) if s <= 6 else \
            LR * f0 * 0.5 * (1 + math.cos(math.pi * (s - 7) / (14 - 6)))
        assert got[s] == pytest.approx(want, rel=1e-12, abs=0), s
    assert got[7] == pytest.approx(planned(10, 7), rel=1e-12)  # continuous at the resume
    assert json.loads((run / "config.json").read_text())["lr_extensions"] == [[6, 14, f0, 0.0]]

    # stretch (the old behaviour, now only on request): warm-up and cosine over 14 from step 7
    # on, the first update after the resume included.
    run = copy("stretch")
    train(cfg_of(corpus, 14), run, resume=True, quiet=True, schedule="stretch")
    got = lrs(run)
    for s in got:
        want = planned(10, s) if s <= 6 else planned(14, s)
        assert got[s] == pytest.approx(want, rel=1e-12, abs=0), s


def test_extend_survives_an_interruption_before_its_first_checkpoint(env):
    tmp, corpus = env
    run = tmp / "r"
    train(cfg_of(corpus, 6), run, quiet=True)  # finished: step 6 of 6, rate 0 next
    # keep and extend of a finished run would train at rate 0: refused, saying so.
    for choice in ("keep", "extend"):
        with pytest.raises(ValueError, match="learning rate 0"):
            train(cfg_of(corpus, 12), run, resume=True, quiet=True, schedule=choice)
    # stretch, interrupted at step 7 before any checkpoint of the new schedule...
    train(cfg_of(corpus, 12), run, resume=True, quiet=True, schedule="stretch", stop_after=7)
    # ... then resumed from step 6 by config.json alone (no --steps, no --schedule).
    cfg = TrainConfig.from_dict(json.loads((run / "config.json").read_text()))
    train(cfg, run, resume=True, quiet=True)
    got = lrs(run)
    assert sorted(got) == list(range(1, 13))
    for s in got:
        want = planned(6, s) if s <= 6 else planned(12, s)
        assert got[s] == pytest.approx(want, rel=1e-12, abs=0), s


def test_a_pinned_schedule_is_kept_and_said(env, capsys):
    tmp, corpus = env
    run = tmp / "r"
    train(cfg_of(corpus, 6, cosine_steps=8), run, quiet=True)  # decays to 0 at step 10
    train(cfg_of(corpus, 9, cosine_steps=8), run, resume=True, quiet=True)
    assert "schedule on resuming at step 6 with --steps 9: keep" in capsys.readouterr().err
    got = lrs(run)
    for s in got:
        assert got[s] == pytest.approx(planned(0, s, cosine=8), rel=1e-12, abs=0), s


def test_runs_without_a_schedule_change_record_their_settings_as_before():
    """compare and sweep compare recorded settings: a plain run's must not gain new keys."""
    d = TrainConfig().to_dict()
    assert "lr_extensions" not in d and "init_from" not in d
    ext = TrainConfig(lr_extensions=((3, 9, 0.5, 0.0),))
    assert TrainConfig.from_dict(json.loads(json.dumps(ext.to_dict()))) == ext


def test_a_schedule_choice_with_nothing_to_decide_says_so():
    from moeify.train.schedule import resume_schedule

    cfg = TrainConfig(steps=10, warmup_steps=2)
    assert resume_schedule(cfg, cfg, 5, None) == (cfg, None)
    same, note = resume_schedule(cfg, cfg, 5, "extend")
    assert same == cfg and note == "--schedule extend changes nothing: --steps is the run's own (10)"
    longer = TrainConfig(steps=20, warmup_steps=2)
    assert "has not trained a step yet" in resume_schedule(cfg, longer, 0, "keep")[1]
    with pytest.raises(ValueError, match="--schedule must be one of keep, extend, stretch"):
        resume_schedule(cfg, longer, 5, "restart")


def test_the_choices_offered_for_a_finished_run_mark_those_that_would_be_refused():
    from moeify.train.schedule import resume_schedule

    done, longer = TrainConfig(steps=10, warmup_steps=2), TrainConfig(steps=20, warmup_steps=2)
    with pytest.raises(ValueError) as err:
        resume_schedule(done, longer, 10, None)
    offered = {part.split()[0]: part for part in str(err.value).split("--schedule ")[1:]}
    assert "refused" in offered["keep"] and "refused" in offered["extend"]
    assert "refused" not in offered["stretch"]


def test_a_huge_steps_resume_computes_rates_on_demand(monkeypatch):
    """resume --steps 10^9 --schedule extend|stretch evaluates the schedule at a few points, not
    once per remaining update (a list of 10^9 rates exhausted memory)."""
    import moeify.train.schedule as schedule

    calls = []
    real = schedule.schedule_factor
    monkeypatch.setattr(schedule, "schedule_factor", lambda cfg, s: calls.append(s) or real(cfg, s))
    trained = TrainConfig(steps=100, warmup_steps=W, lr=LR)
    huge = 1_000_000_000
    for choice in ("extend", "stretch"):
        calls.clear()
        cfg, note = schedule.resume_schedule(trained, TrainConfig(steps=huge, warmup_steps=W, lr=LR),
                                             60, choice)
        assert len(calls) < 1000, f"{choice}: {len(calls)} evaluations"
        assert cfg.lr_extensions[-1][:2] == (60, huge)
        assert note.endswith(f"at step {huge}")
    # extend continues from the current rate (f0 = the trained schedule's factor at step 60).
    calls.clear()
    cfg, _ = schedule.resume_schedule(trained, TrainConfig(steps=huge, warmup_steps=W, lr=LR), 60,
                                      "extend")
    assert cfg.lr_extensions[-1][2] == pytest.approx(lr_factor(60, warmup_steps=W,
                                                               cosine_steps=100 - W))
    # Without a choice the refusal lists the options, also computed on demand.
    calls.clear()
    with pytest.raises(ValueError, match="--schedule extend"):
        schedule.resume_schedule(trained, TrainConfig(steps=huge, warmup_steps=W, lr=LR), 60, None)
    assert len(calls) < 1000


def test_a_schedule_whose_remaining_rates_are_all_zero_is_refused():
    """The on-demand check still finds a schedule that trains every remaining step at 0."""
    from moeify.train.schedule import resume_schedule

    trained = TrainConfig(steps=10, warmup_steps=W, lr=LR, cosine_steps=4)  # floor 0 at step 6
    with pytest.raises(ValueError, match="learning rate 0"):
        resume_schedule(trained, TrainConfig(steps=20, warmup_steps=W, lr=LR, cosine_steps=4), 8,
                        "keep")
