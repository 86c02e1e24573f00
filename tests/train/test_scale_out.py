"""Multi-process runs held to the single-process standard, with real processes under gloo:
FSDP2 and EP x FSDP2 train every preset family and resume in one process; ``--init-from`` under
torchrun initialises one process group per process; a process that dies or hangs leaves the
others with one line naming the latest complete checkpoint; a full disk under a sharded
checkpoint is the single-file message with the same guarantee.

The command-line cases run ``moeify train`` in forked processes that carry torchrun's
environment (WORLD_SIZE, RANK, MASTER_ADDR, ...), so the command makes its own process group as
under torchrun; a death is made deterministic with MOEIFY_EXIT_AT (moeify.train.distributed).
"""

import contextlib
import gc
import io
import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from moeify.rundir import layout
from moeify.train.config import TrainConfig

TINY = ("model.d_model=32", "model.n_layers=2", "model.context_length=16")
FAMILIES = ("tiny-dense", "tiny-switchhead", "tiny-moa", "tiny-sigmamoe", "tiny-switchall",
            "tiny-switch", "tiny-mod", "tiny-mode", "tiny-mode-integrated", "tiny-moeut",
            "tiny-mosa", "tiny-moh")
EXPERT_PARALLEL = ("tiny-switch", "tiny-sigmamoe")  # the expert-parallel presets of docs/guide/scale-out.md
WAIT_S = 240  # a forked group that has not finished by then is a hang


def _cfg(corpus, preset, **kw) -> TrainConfig:
    base = dict(preset=preset, data=str(corpus), tokenizer="byte256", steps=2, batch_size=4,
                warmup_steps=0, lr=3e-3, log_every=1, eval_every=0, eval_tokens=64,
                eval_batch_size=2, checkpoint_every=0, model_overrides=TINY)
    base.update(kw)
    return TrainConfig(**base)


def _start(worker, args, nprocs=2, grace=WAIT_S):
    """Forked processes (an earlier in-process group collected first, see test_fsdp._fork),
    joined with a deadline (``grace`` for the others once process 0 is done): returns their
    exit codes (None: still running, then killed)."""
    gc.collect()
    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="fork")
    codes = []
    for i, p in enumerate(ctx.processes):
        p.join(WAIT_S if i == 0 else grace)
        codes.append(p.exitcode)
    for p in ctx.processes:
        if p.exitcode is None:
            p.kill()
            p.join()
    return codes


# ---------------------------------------------------------------- every family under FSDP2

def _families_worker(rank, world, init_file, jobs, out_file):
    import torch.distributed as dist

    from moeify.train.trainer import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    results = {}
    try:
        for name, cfg_dict, run_dir in jobs:  # one process group for every run
            try:
                res = train(TrainConfig.from_dict(cfg_dict), run_dir, quiet=True, stop_after=1)
                results[name] = [res.losses[s] for s in sorted(res.losses)]
            except Exception as e:  # reported by the test, named by the family
                results[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        torch.save(results, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


def _resume_worker(rank, world, jobs, out_file):
    """One plain process (no process group) per rank, resuming every ``world``-th run of
    ``jobs`` (name, config, run directory); an expert-parallel run first as recorded (which must
    be refused), then at expert_parallel=1. Writes name -> (refusal, final step, its loss)."""
    from moeify.train.trainer import train

    torch.set_num_threads(1)
    results = {}
    for name, cfg_dict, run_dir in jobs[rank::world]:
        try:
            cfg = TrainConfig.from_dict(cfg_dict)
            refusal = None
            if name.endswith("+ep"):  # the recorded degree does not fit one process: say so
                try:
                    train(cfg, run_dir, resume=True, quiet=True)
                except ValueError as e:
                    refusal = str(e)
            res = train(cfg.with_overrides(("parallel=ddp", "expert_parallel=1")), run_dir,
                        resume=True, quiet=True)
            results[name] = (refusal, res.step, res.losses.get(2))
        except Exception as e:  # reported by the test, named by the family
            results[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    torch.save(results, f"{out_file}.{rank}")


def test_every_family_trains_under_fsdp2_and_ep_and_resumes_in_one_process(setup):
    tmp, corpus = setup
    # Two steps planned, one trained (a checkpoint at step 1), the second resumed below.
    kw = dict(parallel="fsdp", steps=2, checkpoint_every=1)
    jobs = [(p, _cfg(corpus, p, **kw).to_dict(), str(tmp / p)) for p in FAMILIES]
    jobs += [(f"{p}+ep", _cfg(corpus, p, expert_parallel=2, **kw).to_dict(),
              str(tmp / f"{p}-ep")) for p in EXPERT_PARALLEL]
    out = tmp / "families.pt"
    assert _start(_families_worker, (2, str(tmp / "pg"), jobs, str(out))) == [0, 0]
    results = torch.load(f"{out}.0")
    failed = {k: v for k, v in results.items() if isinstance(v, str)}
    assert not failed, failed
    for name, _, run_dir in jobs:
        ckpt = layout.latest_checkpoint(run_dir)
        assert (ckpt / layout.DCP_DIR).is_dir() and layout.step_of(ckpt) == 1, name
    # One process, no FSDP: each sharded checkpoint resumes and trains the second step (two
    # single processes side by side, each resuming half of the runs).
    resumed_out = tmp / "resumed.pt"
    assert _start(_resume_worker, (2, jobs, str(resumed_out))) == [0, 0]
    resumed = {**torch.load(f"{resumed_out}.0"), **torch.load(f"{resumed_out}.1")}
    assert resumed.keys() == {j[0] for j in jobs}
    failed = {k: v for k, v in resumed.items() if isinstance(v, str)}
    assert not failed, failed
    for name, _, run_dir in jobs:
        refusal, step, loss = resumed[name]
        if name.endswith("+ep"):
            assert refusal == (
                f"expert_parallel=2 (the run's recorded setting, in {run_dir}/config.json) must "
                "divide the number of processes (1): start a multiple of 2 processes (torchrun "
                "--nproc-per-node 2 -m moeify.cli.main train ...), or change it with --set "
                "expert_parallel=N for N in 1 (a sharded checkpoint resumes at any degree)")
        else:
            assert refusal is None
        assert step == 2 and torch.isfinite(torch.tensor(loss)), name


# ---------------------------------------------------------------- the command under torchrun

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli_worker(rank, world, port, argv, env, out):
    """``moeify train ARGV`` as process RANK of a torchrun group; writes its exit code, stderr
    and how often it initialised a process group."""
    import torch.distributed as dist

    from moeify.cli.main import main

    os.environ.update({"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **env})
    torch.set_num_threads(1)
    inits = []
    real_init = dist.init_process_group
    dist.init_process_group = lambda *a, **k: (inits.append(1), real_init(*a, **k))[1]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(argv)
    finally:
        dist.init_process_group = real_init
    Path(f"{out}.{rank}").write_text(json.dumps({"rc": rc, "err": err.getvalue(),
                                                 "inits": len(inits)}))
    sys.stdout.flush()
    os._exit(0)  # no teardown of inherited state in the forked child


def _run_cli(tmp, argv, env=None, name="cli", grace=WAIT_S):
    """Exit codes and per-rank reports of ``moeify train ARGV`` on two processes."""
    out = tmp / name
    codes = _start(_cli_worker, (2, _free_port(), argv, env or {}, str(out)), grace=grace)
    reports = [json.loads(Path(f"{out}.{r}").read_text()) if Path(f"{out}.{r}").is_file()
               else None for r in range(2)]
    return codes, reports


def _train_args(corpus, out, preset="tiny-sigmamoe", steps=2, *sets):
    return ["train", "--preset", preset, "--data", str(corpus), "--steps", str(steps),
            "--out", str(out), "--quiet",
            *[a for s in ("tokenizer=byte256", "batch_size=4", "eval_every=0", "eval_tokens=64",
                          "eval_batch_size=2", "warmup_steps=0", *TINY, *sets)
              for a in ("--set", s)]]


def _source_run(tmp, corpus, name="src", *sets):
    from moeify.cli.main import main

    src = tmp / name
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(_train_args(corpus, src, "tiny-sigmamoe", 1, *sets)) == 0
    return src


REPEAT = int(os.environ.get("MOEIFY_TEST_REPEAT", "1"))


@pytest.mark.parametrize("sets", [(), ("expert_parallel=2",)], ids=["ddp", "ep"])
def test_init_from_under_torchrun_makes_one_process_group_and_never_hangs(setup, sets):
    """Two trainers in one command (the step-0 run, then its training) share the process group
    the command made: each process initialises one, and the command ends (it hung in about
    half the tries when the second trainer re-initialised a destroyed group)."""
    tmp, corpus = setup
    src = _source_run(tmp, corpus)
    for i in range(REPEAT):
        argv = ["train", "--init-from", str(src), "--out", str(tmp / f"new-{i}"), "--steps",
                "2", "--quiet", *[a for s in sets for a in ("--set", s)]]
        codes, reports = _run_cli(tmp, argv, name=f"init-{i}")
        assert codes == [0, 0], (i, reports)
        assert [r["rc"] for r in reports] == [0, 0], reports
        assert [r["inits"] for r in reports] == [1, 1], reports
        assert layout.step_of(layout.latest_checkpoint(tmp / f"new-{i}")) == 2


def test_init_from_a_sharded_run_takes_its_parallelism_from_the_command_line(setup):
    """The source's parallel settings are not inherited: a new run started from an FSDP run's
    (sharded) checkpoint trains in one plain process unless the command line says otherwise."""
    from moeify.train.start import init_config, train_from
    from moeify.train.trainer import train

    tmp, corpus = setup
    src = tmp / "src"
    train(_cfg(corpus, "tiny-sigmamoe", steps=1, parallel="fsdp"), src, quiet=True)
    cfg = init_config(src)
    assert (cfg.parallel, cfg.expert_parallel) == ("ddp", 1)
    assert init_config(src).with_overrides(("parallel=fsdp",)).parallel == "fsdp"
    res = train_from(cfg, tmp / "new", src, quiet=True)
    assert res.step == cfg.steps
    assert not (layout.latest_checkpoint(tmp / "new") / layout.DCP_DIR).exists()


# ---------------------------------------------------------------- a process that dies or hangs

def _one_line(report) -> str:
    """The error: one line (the data notes of a fresh cache aside), no traceback."""
    lines = [ln for ln in report["err"].splitlines()
             if ln.strip() and not ln.startswith("[moeify]")]
    assert len(lines) == 1, report["err"]
    return lines[0]


@pytest.mark.parametrize("sets,point,latest", [
    ((), "step-3", 2),                         # DDP, between checkpoints: the stop vote
    (("expert_parallel=2",), "step-3", 2),     # EP: the next step's collectives
    ((), "checkpoint-4", 4),                   # just after process 0 published step 4
], ids=["ddp-between", "ep-between", "after-publish"])
def test_a_dead_process_leaves_one_line_naming_the_latest_complete_checkpoint(setup, sets,
                                                                              point, latest):
    tmp, corpus = setup
    run = tmp / "run"
    codes, reports = _run_cli(tmp, _train_args(corpus, run, "tiny-sigmamoe", 6,
                                               "checkpoint_every=2", *sets),
                              env={"MOEIFY_EXIT_AT": f"1:{point}"})
    assert codes[1] == 137 and reports[1] is None  # process 1 died where it was told to
    assert codes[0] == 0 and reports[0]["rc"] == 2
    line = _one_line(reports[0])
    want = run / "checkpoints" / layout.checkpoint_name(latest)
    assert line.startswith("moeify train: error: process 1 of 2 stopped (killed or crashed)")
    assert f"checkpoint {want} is intact" in line
    assert line.endswith(f"resume with: torchrun --nproc-per-node 2 -m moeify.cli.main train "
                         f"--resume {run}")
    assert layout.latest_checkpoint(run) == want


def test_a_hung_process_times_out_with_one_line_naming_the_process_and_step(setup):
    tmp, corpus = setup
    run = tmp / "run"
    # Process 1 stops at step 1 as if stuck; it is killed as soon as process 0 has given up.
    codes, reports = _run_cli(tmp, _train_args(corpus, run, "tiny-dense", 3,
                                               "checkpoint_every=1"),
                              env={"MOEIFY_COLLECTIVE_TIMEOUT": "3",
                                   "MOEIFY_STALL_AT": "1:step-1"}, grace=0)
    assert codes[0] == 0 and reports[0]["rc"] == 2
    line = _one_line(reports[0])
    assert "process 0 of 2 waited more than 3 s for the others during step 2" in line
    assert f"checkpoint {run / 'checkpoints' / layout.checkpoint_name(1)} is intact" in line


# ---------------------------------------------------------------- a full disk, sharded

FULL = "the disk is full: free some space (or write somewhere else) and try again"


def _fail_shards_of(step: int):
    """DCP's file system with a full disk for the shards of checkpoint ``step``."""
    import errno

    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if layout.checkpoint_name(step) in str(path) and str(path).endswith(".distcp"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        with real(self, path, mode) as stream:
            yield stream

    FileSystem.create_stream = create_stream


def _full_disk_worker(rank, world, init_file, cfg_dict, run_dir, out_file):
    import torch.distributed as dist

    from moeify.errors import MoeifyError
    from moeify.train.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        if rank == 1:  # only process 1's disk is full
            _fail_shards_of(2)
        trainer = Trainer(TrainConfig.from_dict(cfg_dict), run_dir, quiet=True)
        try:
            trainer.fit()
            error = None
        except MoeifyError as e:
            error = str(e)
        finally:
            trainer.close()
        Path(f"{out_file}.{rank}").write_text(json.dumps({"error": error}))
    finally:
        dist.destroy_process_group()


def _assert_full_disk_kept_step_1(run, error, resume):
    last = run / "checkpoints" / layout.checkpoint_name(1)
    assert error is not None and "\n" not in error
    assert error.startswith("writing checkpoint step 2 failed: ")
    assert f": {FULL}. The last good checkpoint {last} is intact; continue from it with: " \
           f"{resume} --resume {run}" in error
    assert layout.latest_checkpoint(run) == last
    assert [d.name for d in layout.checkpoint_dirs(run)] == [last.name]
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_a_full_disk_under_two_sharded_processes_says_the_single_file_line(setup):
    tmp, corpus = setup
    run = tmp / "run"
    cfg = _cfg(corpus, "tiny-sigmamoe", parallel="fsdp", expert_parallel=2, checkpoint_every=1)
    out = tmp / "full"
    assert _start(_full_disk_worker, (2, str(tmp / "pg"), cfg.to_dict(), str(run),
                                      str(out))) == [0, 0]
    errors = [json.loads(Path(f"{out}.{r}").read_text())["error"] for r in range(2)]
    assert errors[0] == errors[1]  # every process says the same
    _assert_full_disk_kept_step_1(run, errors[0],
                                  "torchrun --nproc-per-node 2 -m moeify.cli.main train")


@pytest.mark.parametrize("where", ["shards", "state"])
def test_a_full_disk_under_a_one_process_sharded_run_says_the_single_file_line(setup,
                                                                            monkeypatch, where):
    """The same line as a single-file checkpoint's (tests/cli/test_faults.py), whether the
    shards or process 0's state.pt meet the full disk (torch.save's own error on a full disk
    is a RuntimeError: it must come back as the OSError that caused it)."""
    import errno

    from moeify.errors import MoeifyError
    from moeify.rundir import write as ck
    from moeify.train.trainer import Trainer
    from torch.distributed.checkpoint.filesystem import FileSystem

    tmp, corpus = setup
    run = tmp / "run"
    trainer = Trainer(_cfg(corpus, "tiny-dense", parallel="fsdp", checkpoint_every=1), run,
                      quiet=True)
    try:
        trainer.fit(stop_after=1)
        if where == "shards":
            monkeypatch.setattr(FileSystem, "create_stream", FileSystem.create_stream)
            _fail_shards_of(2)
        else:
            class FullDisk:  # a file whose every write meets a full disk
                def __init__(self, path, mode):
                    self.path = path

                def write(self, data):
                    raise OSError(errno.ENOSPC, "No space left on device")

                def flush(self):
                    pass

                def close(self):
                    pass

            monkeypatch.setattr(ck, "open", FullDisk, raising=False)
        with pytest.raises(MoeifyError) as info:
            trainer.fit()
    finally:
        trainer.close()
    _assert_full_disk_kept_step_1(run, str(info.value), "moeify train")
