"""FSDP2 and sharded checkpoints on CPU (gloo): two sharded processes train like one process with
the same global batch, their checkpoint resumes in one process and continues exactly, eval reads
it, and a process killed while writing a sharded checkpoint leaves the previous one loadable."""

import errno
import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from moeify.errors import MoeifyError
from moeify.rundir import layout
from moeify.rundir import checkpoints as ckr
from moeify.rundir import load_trained
from moeify.rundir import sharded
from moeify.train.config import TrainConfig
from moeify.train.trainer import NonFiniteLoss, Trainer, train
from moeify.train.validate import evaluate_stream
from process_groups import gloo_group

# SwitchHead attention and a sigma-MoE feedforward: both kinds of routing-usage buffer.
TINY = ("model.d_model=32", "model.n_layers=2", "model.context_length=16")
STEPS = 20


def _fork(worker, args, nprocs, join, start_method):
    """mp.start_processes after collecting garbage: a gloo process group an earlier in-process
    test left to the collector must be destroyed here, not in a forked child (where its
    destructor can wait forever on a lock copied mid-use)."""
    gc.collect()
    return mp.start_processes(worker, args=args, nprocs=nprocs, join=join,
                              start_method=start_method)


def _usage(model) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if n.split(".")[-1].startswith("usage")}


def _worker(rank, world, init_file, cfg_dict, run_dir, out_file):
    with gloo_group(rank, world, init_file):
        trainer = Trainer(TrainConfig.from_dict(cfg_dict), run_dir, quiet=True)
        res = trainer.fit()
        torch.save({"losses": res.losses, "valid": res.valid, "usage": _usage(trainer.model),
                    "sharded": trainer.sharded}, f"{out_file}.{rank}")
        trainer.close()


def _cfg(corpus, **kw) -> TrainConfig:
    base = dict(preset="tiny-switchall", data=str(corpus), tokenizer="byte256", steps=STEPS,
                batch_size=4, warmup_steps=2, lr=3e-3, log_every=1, eval_every=0,
                eval_tokens=256, eval_batch_size=2, checkpoint_every=10, model_overrides=TINY)
    base.update(kw)
    return TrainConfig(**base)


def test_two_sharded_processes_match_one_process_and_resume_in_one(setup):
    tmp, corpus = setup
    cfg = _cfg(corpus)
    one = Trainer(cfg, tmp / "one", quiet=True)
    single = one.fit()
    usage_one = _usage(one.model)
    one.close()

    out = tmp / "fsdp.pt"
    fsdp_cfg = _cfg(corpus, parallel="fsdp")
    _fork(_worker, args=(2, str(tmp / "pg"), fsdp_cfg.to_dict(), str(tmp / "two"),
                                      str(out)), nprocs=2, join=True, start_method="fork")
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    two = ranks[0]
    assert two["sharded"]
    assert sorted(two["losses"]) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert abs(two["losses"][s] - single.losses[s]) < 1e-5, (s, two["losses"][s],
                                                                 single.losses[s])
    assert single.losses[STEPS] < single.losses[1] - 0.2  # it trained
    assert abs(two["valid"]["loss"] - single.valid["loss"]) < 1e-5
    # Routing-usage buffers count each process's own tokens: the two add up to the one.
    assert usage_one and usage_one.keys() == ranks[1]["usage"].keys()
    for name, counts in usage_one.items():
        assert torch.equal(ranks[0]["usage"][name] + ranks[1]["usage"][name], counts), name

    # The checkpoints are sharded: one DCP file per process, no single-file weights.
    step10 = tmp / "two" / layout.CHECKPOINTS / layout.checkpoint_name(10)
    assert ckr.is_sharded_checkpoint(step10)
    assert len(list((step10 / layout.DCP_DIR).glob("*.distcp"))) == 2
    assert not (step10 / layout.MODEL_FILE).exists()

    # eval / generate read the sharded checkpoint into a plain model.
    tm = load_trained(tmp / "two")
    assert tm.checkpoint.step == STEPS
    res = evaluate_stream(tm.model, one.valid_tokens, tm.tokenizer, seq_len=16, batch_size=2,
                          max_tokens=256, device=torch.device("cpu"), amp_dtype=None)
    assert abs(res["loss"] - single.valid["loss"]) < 1e-5

    # Resume the 2-process checkpoint of step 10 in one unsharded process: steps 11..20 repeat.
    resumed = train(_cfg(corpus, parallel="ddp"), tmp / "two", resume=step10, quiet=True)
    assert sorted(resumed.losses) == list(range(11, STEPS + 1))
    for s in range(11, STEPS + 1):
        assert abs(resumed.losses[s] - two["losses"][s]) < 1e-5, (s, resumed.losses[s],
                                                                  two["losses"][s])


def _dying_worker(cfg_dict, run_dir):
    torch.set_num_threads(1)
    real_finish = sharded._finish

    def finish(tmp, name, step, *args, **kwargs):
        if step == 4:  # every shard of step 4 is on disk; die before meta.json and the rename
            os._exit(3)
        return real_finish(tmp, name, step, *args, **kwargs)

    sharded._finish = finish
    train(TrainConfig.from_dict(cfg_dict), run_dir, quiet=True)


def test_a_process_killed_while_writing_a_sharded_checkpoint_leaves_the_previous_one(setup):
    tmp, corpus = setup
    cfg = _cfg(corpus, parallel="fsdp", steps=4, checkpoint_every=2)
    ctx = mp.get_context("fork")
    gc.collect()  # as in _fork
    p = ctx.Process(target=_dying_worker, args=(cfg.to_dict(), str(tmp / "run")))
    p.start()
    p.join()
    assert p.exitcode == 3
    root = tmp / "run" / layout.CHECKPOINTS
    assert [d.name for d in layout.checkpoint_dirs(tmp / "run")] == [layout.checkpoint_name(2)]
    assert layout.latest_checkpoint(tmp / "run").name == layout.checkpoint_name(2)
    assert list(root.glob(".tmp-*/dcp/*.distcp"))  # the half-written one is there, ignored
    assert load_trained(tmp / "run").checkpoint.step == 2
    # The run resumes from step 2 (one sharded process) and cleans the leftover up.
    res = train(cfg, tmp / "run", resume=True, quiet=True)
    assert sorted(res.losses) == [3, 4]
    assert not list(root.glob(".tmp-*"))
    assert layout.latest_checkpoint(tmp / "run").name == layout.checkpoint_name(4)


def test_a_corrupt_shard_is_refused_with_a_clear_error(setup):
    tmp, corpus = setup
    train(_cfg(corpus, parallel="fsdp", steps=2, checkpoint_every=2), tmp / "run", quiet=True)
    ckpt = layout.latest_checkpoint(tmp / "run")
    shard = next((ckpt / layout.DCP_DIR).glob("*.distcp"))
    shard.write_bytes(b"x" + shard.read_bytes()[1:])
    with pytest.raises(Exception, match="corrupt.*checksum"):
        load_trained(tmp / "run")


def _poisoning_worker(rank, world, init_file, cfg_dict, run_dir, out_file):
    """Rank 1 puts a NaN into its own shard of one weight; both ranks try to checkpoint."""
    with gloo_group(rank, world, init_file):
        trainer = Trainer(TrainConfig.from_dict(cfg_dict), run_dir, quiet=True)
        name, param = next((n, p) for n, p in trainer.model.named_parameters()
                           if p.dim() >= 2 and p.shape[0] >= world)
        if rank == 1:
            with torch.no_grad():
                param.to_local()[0, 0] = float("nan")
        try:
            trainer.save_checkpoint()
            error = None
        except MoeifyError as e:
            error = str(e)
        torch.save({"name": name, "error": error}, f"{out_file}.{rank}")
        trainer.close()


def test_a_non_finite_shard_on_one_process_is_refused_by_every_process(setup):
    tmp, corpus = setup
    cfg = _cfg(corpus, parallel="fsdp")
    out = tmp / "poison.pt"
    _fork(_poisoning_worker, args=(2, str(tmp / "pg"), cfg.to_dict(),
                                                str(tmp / "run"), str(out)),
                       nprocs=2, join=True, start_method="fork")
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for r in ranks:  # rank 0's own shards are finite: it refuses because rank 1's are not
        assert r["error"] is not None
        assert "non-finite" in r["error"] and r["name"] in r["error"], r["error"]
        assert "was not written" in r["error"]
    root = tmp / "run" / layout.CHECKPOINTS
    assert layout.checkpoint_dirs(tmp / "run") == []
    assert not list(root.glob(".tmp-*"))


def test_a_failed_sharded_write_removes_its_temporary_directory(setup, monkeypatch):
    tmp, corpus = setup
    run = tmp / "run"
    trainer = Trainer(_cfg(corpus, parallel="fsdp", steps=4, checkpoint_every=2), run,
                      quiet=True)
    try:
        trainer.fit(stop_after=2)
        root = run / layout.CHECKPOINTS
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (root / f".tmp-step-00000003-{dead}" / layout.DCP_DIR).mkdir(parents=True)

        def full_disk(tmp_dir, *args, **kwargs):
            assert list((tmp_dir / layout.DCP_DIR).glob("*.distcp"))  # the shards were written
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_dir / layout.STATE_FILE))

        monkeypatch.setattr(sharded, "_finish", full_disk)
        with pytest.raises(MoeifyError, match="step 4.*the disk is full"):
            trainer.fit()
    finally:
        trainer.close()
    assert not list(root.glob(".tmp-*"))  # neither this write's nor the dead writer's
    assert [d.name for d in layout.checkpoint_dirs(run)] == [layout.checkpoint_name(2)]
    assert layout.latest_checkpoint(run).name == layout.checkpoint_name(2)
    assert load_trained(run).checkpoint.step == 2


def _signalled_worker(rank, world, init_file, cfg_dict, run_dir, out_file):
    """Rank 1 receives SIGTERM during step 3; the other rank learns it through the per-step
    agreement and both stop after step 3 with one sharded checkpoint."""
    import signal

    with gloo_group(rank, world, init_file):
        import io

        said = io.StringIO()
        trainer = Trainer(TrainConfig.from_dict(cfg_dict), run_dir, quiet=True, stream=said)
        real_step = trainer.train_step

        def step():
            rec = real_step()
            if rank == 1 and trainer.step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return rec

        trainer.train_step = step
        res = trainer.fit()
        torch.save({"step": res.step, "losses": sorted(res.losses),
                    "checkpoint": str(res.checkpoint), "said": said.getvalue()},
                   f"{out_file}.{rank}")
        trainer.close()


def test_a_signal_to_one_sharded_process_stops_all_with_a_checkpoint(setup):
    tmp, corpus = setup
    cfg = _cfg(corpus, parallel="fsdp", steps=6, checkpoint_every=0)
    out = tmp / "signal.pt"
    _fork(_signalled_worker, args=(2, str(tmp / "pg"), cfg.to_dict(),
                                                str(tmp / "run"), str(out)),
                       nprocs=2, join=True, start_method="fork")
    for r in range(2):
        got = torch.load(f"{out}.{r}")
        assert got["step"] == 3 and got["losses"] == [1, 2, 3], (r, got)
    # The resume hint is a command that resumes a two-process run.
    assert got["said"] == "" and torch.load(f"{out}.0")["said"].strip().endswith(
        f"resume with: torchrun --nproc-per-node 2 -m moeify.cli.main train --resume "
        f"{tmp / 'run'}")
    step3 = tmp / "run" / layout.CHECKPOINTS / layout.checkpoint_name(3)
    assert [d.name for d in layout.checkpoint_dirs(tmp / "run")] == [step3.name]
    assert ckr.is_sharded_checkpoint(step3)
    assert len(list((step3 / layout.DCP_DIR).glob("*.distcp"))) == 2


def test_a_sharded_checkpoint_of_the_weights_that_diverged_is_set_aside(setup):
    tmp, corpus = setup
    run = tmp / "run"
    cfg = _cfg(corpus, parallel="fsdp", steps=6, checkpoint_every=1, lr=1e30)
    with pytest.raises(NonFiniteLoss, match="loss became nan.*set aside"):
        train(cfg, run, quiet=True)
    # No checkpoint a reader can reach holds weights that give a non-finite loss.
    assert layout.checkpoint_dirs(run) == [] and not (run / layout.CHECKPOINTS / "latest").exists()
    aside = run / layout.CHECKPOINTS / f"diverged-{layout.checkpoint_name(1)}"
    assert ckr.is_sharded_checkpoint(aside)


def _diverging_worker(rank, world, init_file, cfg_dict, run_dir, out_file):
    with gloo_group(rank, world, init_file):
        trainer = Trainer(TrainConfig.from_dict(cfg_dict), run_dir, quiet=True)
        try:
            trainer.fit()
            error = None
        except NonFiniteLoss as e:
            error = str(e)
        torch.save({"error": error, "last": trainer.last_checkpoint}, f"{out_file}.{rank}")
        trainer.close()


def test_two_sharded_processes_agree_to_set_a_diverged_checkpoint_aside(setup):
    tmp, corpus = setup
    cfg = _cfg(corpus, parallel="fsdp", steps=6, checkpoint_every=1, lr=1e30)
    out = tmp / "diverged.pt"
    _fork(_diverging_worker, args=(2, str(tmp / "pg"), cfg.to_dict(),
                                                str(tmp / "run"), str(out)),
                       nprocs=2, join=True, start_method="fork")
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    assert "set aside" in ranks[0]["error"]
    assert all(r["error"] and "loss became nan" in r["error"] for r in ranks)
    assert all(r["last"] is None for r in ranks)  # both know no good checkpoint remains
    assert layout.checkpoint_dirs(tmp / "run") == []
    assert ckr.is_sharded_checkpoint(
        tmp / "run" / layout.CHECKPOINTS / f"diverged-{layout.checkpoint_name(1)}")
