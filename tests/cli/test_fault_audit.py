"""The fault audit of the newer surfaces (issue 32): compare/sweep sharing an --out, full disks
under plot/export/import/upcycle/sweep, corrupt harness data, undecodable prompts, signals,
a dead FSDP rank, leftovers of killed processes, closed pipes and the messages of bad input.

Each case checks the exit code, that the message is one line saying what to do (never a
traceback), and that nothing on disk is lost or replaced. Models are tiny and runs a few steps."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeify.cli.main import main
from harness_env import harness_offline

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--set", "batch_size=2", "--set", "model.d_model=16", "--set", "model.n_layers=1",
         "--set", "model.context_length=16", "--set", "eval_every=0", "--set",
         "eval_tokens=64", "--set", "log_every=1", "--set", "tokenizer=byte",
         "--threads", "1", "--final-eval-tokens", "64"]


def one_line_error(capsys, command) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error message"
    last = err[-1]
    assert last.startswith(f"moeify {command}: error: "), last
    assert "Traceback" not in "\n".join(err) and "  " not in last
    return last


def _env(tmp: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "MOEIFY_NO_MALLOC_TUNING": "1",
            "MOEIFY_CACHE_DIR": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}


def _moeify(tmp: Path, *argv, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moeify.cli.main", *argv], env=_env(tmp),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for_training(run: Path, proc: subprocess.Popen, timeout=120.0) -> None:
    """Until the run's trainer (the first process's child) has locked it and logged a step."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if (run / ".lock").is_file() and (run / "metrics.jsonl").is_file():
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{run} never started training")


# ------------------------------------------------- 1: two compare/sweep processes on one --out

def test_second_compare_on_a_live_out_is_refused_and_the_first_keeps_its_run(text_corpus):
    out = text_corpus / "out"
    argv = ["compare", "--presets", "tiny-dense", "--data", str(text_corpus / "corpus.txt"),
            "--steps", "40", "--out", str(out), "--blimp-per-paradigm", "0", *SMALL]
    first = _moeify(text_corpus, *argv)
    try:
        _wait_for_training(out / "runs" / "tiny-dense", first)
        second = _moeify(text_corpus, *argv, "--seed", "1")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert f"in use by another moeify compare, pid {first.pid}" in err
        assert "--out" in err
    finally:
        _, err1 = first.communicate(timeout=300)
    assert first.returncode == 0, err1
    run = out / "runs" / "tiny-dense"
    assert json.loads((run / "compare_spec.json").read_text())["train_config"]["seed"] == 0
    assert json.loads((out / "results.json").read_text())["settings"]["seed"] == 0
    assert (run / "compare_child.json").is_file() and not (out / ".lock").exists()


def test_second_sweep_on_a_live_out_is_refused_and_the_first_keeps_its_run(text_corpus):
    out = text_corpus / "out"
    argv = ["sweep", "--presets", "tiny-dense", "--budgets", "40", "--data",
            str(text_corpus / "corpus.txt"), "--out", str(out), *SMALL]
    first = _moeify(text_corpus, *argv, "--set", "lr=5e-3")
    try:
        _wait_for_training(out / "runs" / "base" / "tiny-dense" / "steps-40" / "seed-0", first)
        second = _moeify(text_corpus, *argv, "--set", "lr=1e-3")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err
        assert f"in use by another moeify sweep, pid {first.pid}" in err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    finally:
        _, err1 = first.communicate(timeout=300)
    assert first.returncode == 0, err1
    run = out / "runs" / "base" / "tiny-dense" / "steps-40" / "seed-0"
    assert json.loads((run / "compare_spec.json").read_text())["train_config"]["lr"] == 5e-3
    assert json.loads((out / "results.json").read_text())["recipe"]["shared"]["lr"] == 5e-3


HOLD = ("import sys; from moeify.rundir.lock import RunLock; "
        "lock = RunLock(sys.argv[1]).acquire(); print('locked', flush=True); "
        "sys.stdin.read(); lock.release()")


def _spec(run_dir, **changes):
    cfg = {"preset": "tiny-dense", "seed": 0, "steps": 3, "lr": 5e-3, **changes}
    return {"name": "tiny-dense", "preset": "tiny-dense", "train_config": cfg,
            "run_dir": str(run_dir), "threads": 1, "final_eval_tokens": 64,
            "blimp_per_paradigm": 0, "blimp_data": None}


def test_a_run_directory_locked_by_a_live_process_is_never_cleared(tmp_path):
    """An orphaned child of a killed compare still trains in it: the next compare refuses it."""
    from moeify.sweep.protocol import SPEC_FILE
    from moeify.sweep.scheduler import plan_run
    from moeify.errors import MoeifyError

    run = tmp_path / "runs" / "tiny-dense"
    run.mkdir(parents=True)
    (run / SPEC_FILE).write_text(json.dumps(_spec(run)))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=_env(tmp_path))
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(MoeifyError, match=f"in use by another process, pid {holder.pid}"):
            plan_run(run, _spec(run, seed=1), reuse=True)
        assert (run / SPEC_FILE).is_file() and (run / ".lock").is_file()
    finally:
        holder.stdin.close()
        holder.wait()
    plan_run(run, _spec(run, seed=1), reuse=True)  # nothing trained, nobody in it: cleared
    assert not run.exists()


def test_reuse_under_other_settings_is_refused_naming_the_setting(tmp_path):
    from moeify.sweep.protocol import CHILD_RESULT, SPEC_FILE
    from moeify.sweep.scheduler import plan_run
    from moeify.errors import MoeifyError

    run = tmp_path / "r"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "checkpoints" / "step-00000002" / "meta.json").write_text("{}")
    (run / SPEC_FILE).write_text(json.dumps(_spec(run)))
    with pytest.raises(MoeifyError, match=r"unfinished run with other settings \(seed 0 -> 1\)"):
        plan_run(run, _spec(run, seed=1), reuse=True)
    with pytest.raises(MoeifyError, match=r"lr 0.005 -> 0.001"):
        plan_run(run, _spec(run, lr=1e-3), reuse=True)
    assert (run / "checkpoints" / "step-00000002").is_dir()  # nothing deleted
    spec = {**_spec(run), "threads": 4}  # how it is scheduled does not define the run
    assert plan_run(run, spec, reuse=True) is None and spec["resume"] is True
    (run / CHILD_RESULT).write_text(json.dumps({"final_valid": 1.0}))
    with pytest.raises(MoeifyError, match=r"finished run with other settings \(seed 0 -> 1\)"):
        plan_run(run, _spec(run, seed=1), reuse=True)
    assert plan_run(run, _spec(run), reuse=True) == {"final_valid": 1.0}


# ------------------------------------------------- 2: full disks

TINY_TRAIN = ["--set", "tokenizer=byte256", "--set", "model.d_model=16", "--set",
              "model.n_layers=1", "--set", "model.context_length=16", "--set",
              "model.feedforward.d_ff=32", "--set", "batch_size=2", "--set", "warmup_steps=0",
              "--set", "eval_tokens=64", "--set", "eval_batch_size=2", "--set", "eval_every=0",
              "--set", "log_every=1", "--quiet"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 2-step tiny run (dense preset), trained once for the module."""
    import numpy as np

    root = tmp_path_factory.mktemp("audit")
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEIFY_CACHE_DIR", str(root / "cache"))
    rng = np.random.default_rng(5)
    words = "the cat sat on a warm mat by the door".split()
    (root / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, 8))
                                               for _ in range(200)))
    try:
        assert main(["train", "--preset", "tiny-dense", "--data", str(root / "corpus.txt"),
                     "--steps", "2", "--out",
                     str(root / "run"), *TINY_TRAIN]) == 0
        yield root / "run"
    finally:
        mp.undo()


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_plot_on_a_full_disk_keeps_the_old_png_and_names_it(tiny_run, tmp_path, capsys,
                                                            monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    png = tmp_path / "curves.png"
    assert main(["plot", "curves", str(tiny_run), "--out", str(png)]) == 0
    good = png.read_bytes()

    def half_then_full(self, target, **kw):  # what a disk that fills mid-write does
        f = open(target, "wb") if isinstance(target, (str, os.PathLike)) else target
        f.write(good[: len(good) // 2])
        f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(FigureCanvasAgg, "print_png", half_then_full)
    capsys.readouterr()
    assert main(["plot", "curves", str(tiny_run), "--out", str(png)]) == 2
    assert f"{png}: the disk is full" in one_line_error(capsys, "plot")
    assert png.read_bytes() == good  # the good PNG is kept
    assert main(["plot", "curves", str(tiny_run), "--out", str(tmp_path / "new.png")]) == 2
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png"]  # no 0-byte file


# ------------------------------------------------- 3: leftovers of killed processes

def test_a_kill_while_pruning_leaves_no_hollow_checkpoint(tmp_path, monkeypatch):
    import shutil

    import torch

    from moeify.rundir import write as ck
    from moeify.rundir import layout

    ck.save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, {}, keep=1)
    real_rmtree = shutil.rmtree

    def killed_half_way(path, *a, **k):  # deletes one file, then the process is killed
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
        files[0].unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ck.shutil, "rmtree", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {}, keep=1)
    monkeypatch.setattr(ck.shutil, "rmtree", real_rmtree)
    root = tmp_path / layout.CHECKPOINTS
    assert not (root / "step-00000001").exists()  # never a hollow step-N
    assert [p.name for p in layout.checkpoint_dirs(tmp_path)] == ["step-00000002"]
    ck.sweep_stale(root)  # what the next trainer does (the owner is gone, or it is us)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002"]


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True)
    return int(p.stdout)


def test_export_on_a_full_disk_is_one_line_and_writes_nothing(tiny_run, tmp_path, capsys,
                                                              monkeypatch):
    pytest.importorskip("transformers")
    import safetensors.torch
    from safetensors import SafetensorError

    def full(state, path, metadata=None):
        Path(path).write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              f"(os error 28) at path \"{path}\"")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "hf"
    assert main(["export", "--run", str(tiny_run), "--out", str(out)]) == 2
    msg = one_line_error(capsys, "export")
    assert f"{out}/model.safetensors: the disk is full" in msg
    assert list(tmp_path.iterdir()) == []


def test_leftovers_of_killed_imports_and_exports_are_swept(tiny_run, tmp_path, capsys):
    pytest.importorskip("transformers")
    dead, live = _dead_pid(), os.getppid()
    out = tmp_path / "hf"
    for name in (f".hf.export-{dead}", f".hf.import-{dead}", f".hf.export-{live}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 100)
    assert main(["export", "--run", str(tiny_run), "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".hf.export-{live}", "hf"]
    run = tmp_path / "imported"
    (tmp_path / f".imported.import-{dead}").mkdir()
    assert main(["import", "--hf", str(out), "--out", str(run)]) in (0, 2)  # swept either way
    assert not (tmp_path / f".imported.import-{dead}").exists()


def test_import_on_a_full_disk_names_the_output(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from moeify.interop.hf_export import byte_level_tokenizer_json
    from moeify.rundir import write as ck

    cfg = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    src = tmp_path / "src"
    transformers.GPT2LMHeadModel(cfg).save_pretrained(src)
    (src / "tokenizer.json").write_bytes(byte_level_tokenizer_json(range(256), unk=False))

    def full(run_dir, *a, **k):
        (Path(run_dir) / "checkpoints").mkdir(exist_ok=True)
        (Path(run_dir) / "checkpoints" / "half").write_bytes(b"x")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ck, "save_checkpoint", full)
    out = tmp_path / "run"
    assert main(["import", "--hf", str(src), "--out", str(out)]) == 2
    assert f"{out}: the disk is full" in one_line_error(capsys, "import")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_upcycle_is_all_or_nothing_and_sweeps_a_killed_attempt(tiny_run, tmp_path, capsys,
                                                               monkeypatch):
    from moeify.rundir import write as ck

    out = tmp_path / "up"
    argv = ["upcycle", "--run", str(tiny_run), "--out", str(out), "--ff", "sigma-moe:E=2,k=1",
            "--no-validate"]

    def full(run_dir, *a, **k):  # the step-0 checkpoint's state.pt does not fit
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                      str(Path(run_dir) / "checkpoints" / "step-00000000" / "state.pt"))

    monkeypatch.setattr(ck, "save_checkpoint", full)
    assert main(argv) == 2
    msg = one_line_error(capsys, "upcycle")
    assert f"{out}/checkpoints/step-00000000/state.pt: the disk is full" in msg
    assert ".upcycle-" not in msg
    assert list(tmp_path.iterdir()) == []  # no half-made run directory
    monkeypatch.undo()
    # A kill -9 during an upcycle leaves its temporary directory (with the trainer's .lock).
    killed = tmp_path / f".up.upcycle-{_dead_pid()}"
    killed.mkdir()
    (killed / ".lock").write_text("{}")
    assert main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["up"]
    assert (out / "checkpoints" / "latest").is_file() and not (out / ".lock").exists()


def test_upcycle_steps_given_twice_is_refused(tiny_run, tmp_path, capsys):
    assert main(["upcycle", "--run", str(tiny_run), "--out", str(tmp_path / "up"), "--ff",
                 "sigma-moe:E=2,k=1", "--steps", "10", "--set", "steps=20"]) == 2
    assert "--steps 10 and --set steps=20 both set" in one_line_error(capsys, "upcycle")
    assert not (tmp_path / "up").exists()


# ------------------------------------------------- 4: closed pipes

@pytest.mark.parametrize("argv", [["presets"], ["count", "--preset", "tiny-dense", "--json"]])
def test_a_closed_stdout_pipe_ends_quietly(argv, tmp_path):
    """`moeify presets | head -1`: the reader is gone before (or while) the command writes."""
    r, w = os.pipe()
    os.close(r)
    p = subprocess.run([sys.executable, "-m", "moeify.cli.main", *argv], stdout=w,
                       stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
    os.close(w)
    assert p.stderr == "" and p.returncode == 141, p.stderr


# ------------------------------------------------- 5: generate's prompt

@pytest.fixture(scope="module")
def imported_gpt2(tmp_path_factory):
    """A tiny random GPT-2 imported through the CLI (its tokenizer is a Hugging Face one)."""
    transformers = pytest.importorskip("transformers")
    from moeify.interop.hf_export import byte_level_tokenizer_json

    root = tmp_path_factory.mktemp("gpt2")
    cfg = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(root / "src")
    (root / "src" / "tokenizer.json").write_bytes(byte_level_tokenizer_json(range(256),
                                                                           unk=False))
    assert main(["import", "--hf", str(root / "src"), "--out", str(root / "run")]) == 0
    return root / "run"


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_a_non_utf8_prompt_is_one_line(kind, tiny_run, imported_gpt2, capsys):
    run = tiny_run if kind == "byte" else imported_gpt2
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")  # what Python makes of a Latin-1 argv
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", bad, "--max-new-tokens", "2"]) == 2
    msg = one_line_error(capsys, "generate")
    assert "--prompt is not UTF-8 text (byte 0xe9 at character 3)" in msg and "codec" not in msg


def test_long_prompts_come_from_a_file_or_stdin(tiny_run, tmp_path, capsys, monkeypatch):
    import io

    text = "the cat sat on the mat. " * 8000  # 192 KB: more than one argument may hold
    (tmp_path / "p.txt").write_text(text)
    capsys.readouterr()
    assert main(["generate", "--run", str(tiny_run), "--prompt-file", str(tmp_path / "p.txt"),
                 "--max-new-tokens", "3", "--seed", "0", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(text) and len(out) > len(text)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert main(["generate", "--run", str(tiny_run), "--prompt-file", "-",
                 "--max-new-tokens", "3", "--seed", "0", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == out
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    assert main(["generate", "--run", str(tiny_run), "--prompt-file",
                 str(tmp_path / "bad.txt")]) == 2
    assert "bad.txt is not UTF-8 text" in one_line_error(capsys, "generate")


# ------------------------------------------------- 6: the harness

def test_harness_corrupt_jsonl_and_broken_task_yaml_are_one_line(tiny_run, tmp_path, capsys,
                                                                  monkeypatch):
    pytest.importorskip("lm_eval")
    harness_offline(monkeypatch, tmp_path)
    data = tmp_path / "data"
    (data / "lambada").mkdir(parents=True)
    (data / "lambada" / "lambada_test.jsonl").write_text(
        json.dumps({"text": "the cat sat on the mat"}) + "\n{\"text\": \"torn\n")
    capsys.readouterr()
    assert main(["eval", "--run", str(tiny_run), "--harness", "moeify_lambada", "--data-dir",
                 str(data), "--device", "cpu"]) == 2
    msg = one_line_error(capsys, "eval")
    assert "lambada_test.jsonl:2: not a JSON line" in msg
    # the same file through --task lambada is as clear
    assert main(["eval", "--run", str(tiny_run), "--task", "lambada", "--data",
                 str(data / "lambada" / "lambada_test.jsonl")]) == 2
    assert "lambada_test.jsonl:2:" in one_line_error(capsys, "eval")

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text("task: mine\ndataset_path: json\n  bad: [indent\n")
    assert main(["eval", "--run", str(tiny_run), "--harness", "mine", "--harness-include",
                 str(tasks), "--device", "cpu"]) == 2
    msg = one_line_error(capsys, "eval")
    assert "mine.yaml:3: the task file is not valid YAML" in msg and "unknown" not in msg


# ------------------------------------------------- 7: signals

LATE_SIGNAL = """
import atexit, os, signal, sys, time
def second_ctrl_c():  # arrives while the interpreter exits, after the clean stop
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
atexit.register(second_ctrl_c)
import moeify.rundir.write as ck
from moeify.cli.main import main
real = ck.save_state
def save(state, path):
    if state["step"] == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return real(state, path)
ck.save_state = save
sys.argv = ["moeify", *sys.argv[1:]]
sys.exit(main())
"""


def test_a_second_ctrl_c_during_exit_is_no_traceback(text_corpus):
    run = text_corpus / "r"
    p = subprocess.run([sys.executable, "-c", LATE_SIGNAL, "train", "--preset", "tiny-dense",
                        "--data", str(text_corpus / "corpus.txt"), "--steps", "6", "--out",
                        str(run), *TINY_TRAIN, "--set", "checkpoint_every=2"],
                       capture_output=True, text=True, env=_env(text_corpus))
    assert p.returncode == 130, p.stderr
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr
    assert "stopped by SIGINT" in p.stderr
    assert (run / "checkpoints" / "latest").is_file()


# ------------------------------------------------- 8: a dead process of a sharded run
# The pieces: a collective whose peer died raises PeerLost (a real 2-process gloo group, the
# peer exits), and PeerLost becomes one line naming the dead process, the latest complete
# checkpoint and the resume command (whole runs with a process that dies at a named point:
# tests/train/test_scale_out.py).

PEER_DIES = """
import os, sys, torch.distributed as dist
from moeify.train.distributed import DistEnv, PeerLost
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
env = DistEnv(rank=rank, world_size=2)
env.barrier()
if rank == 1:
    os._exit(9)  # as a kill -9 would
try:
    env.broadcast_object("tmp-dir")
    env.all_gather_object("rng")
except PeerLost as e:
    print("PeerLost", e.rank, e.world_size, e.what, flush=True)
    os._exit(0)
print("no error", flush=True)
os._exit(1)
"""


def test_a_collective_whose_peer_died_raises_peer_lost(tmp_path):
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", PEER_DIES, str(r), str(store)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(tmp_path)) for r in (0, 1)]
    out, err = procs[0].communicate(timeout=120)
    procs[1].wait(timeout=60)
    assert procs[0].returncode == 0, out + err
    assert out.split()[:3] == ["PeerLost", "0", "2"]


def test_a_dead_process_during_a_sharded_checkpoint_is_one_line(tmp_path):
    from moeify.train.distributed import DistEnv, PeerLost, collective_failure, \
        peer_lost_message

    run = tmp_path / "run"
    intact = run / "checkpoints" / "step-00000004"  # the latest complete one on disk
    intact.mkdir(parents=True)
    (intact / "meta.json").write_text("{}")
    dead = PeerLost(0, 2, "broadcast_object", "Connection closed by peer [127.0.0.1]:4242")
    msg = collective_failure(dead, DistEnv(rank=0, world_size=2),
                             "the sharded checkpoint of step 6", run)
    assert msg == (f"process 1 of 2 stopped (killed or crashed) during the sharded checkpoint "
                   f"of step 6, so process 0 stops too; checkpoint {intact} is intact; resume "
                   f"with: torchrun --nproc-per-node 2 -m moeify.cli.main train --resume {run}")
    assert "\n" not in msg
    assert "another process of 4" in peer_lost_message(2, 4, "x", None, run)
    assert "no checkpoint had been written yet" in peer_lost_message(2, 4, "x", None, run)


# ------------------------------------------------- 9: a compare/sweep child that fails

def test_a_failed_child_is_one_line_in_the_parents_message(text_corpus, capsys, monkeypatch):
    import types

    from moeify.errors import MoeifyError
    from moeify.sweep import child, protocol, scheduler

    # The child on a full disk says one error line (into its log), exit 2 ...
    run = text_corpus / "run"
    run.mkdir()
    spec = {**_spec(run), "train_config": {"preset": "tiny-dense", "steps": 3,
                                           "data": str(text_corpus / "corpus.txt")}}
    (run / protocol.SPEC_FILE).write_text(json.dumps(spec))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run / "checkpoints"))

    monkeypatch.setattr(child, "train_child", full)
    assert child.child_entry(str(run / protocol.SPEC_FILE)) == 2
    said = capsys.readouterr().err.strip()
    assert said == f"error: {run / 'checkpoints'}: the disk is full: free some space (or " \
                   "write somewhere else) and try again"
    # ... which the parent quotes, in one line, with where the whole log is.
    log = run / protocol.CHILD_LOG
    sched = scheduler.Scheduler([], jobs=1)
    for text, quoted in ((f"[moeify] training ...\n{said}\n", said[len("error: "):]),
                         ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                          "RuntimeError: boom\n", "RuntimeError: boom")):
        log.write_text(text)
        sched.running[4242] = (types.SimpleNamespace(), {"name": "tiny-dense",
                                                         "run_dir": str(run)}, 0.0)
        with pytest.raises(MoeifyError) as e:
            sched._reap(4242, 2 << 8, None)
        assert str(e.value) == (f"training tiny-dense failed (exit 2): {quoted}; the whole log "
                                f"is {log}")


# ------------------------------------------------- 10: sweep arguments checked up front

@pytest.mark.parametrize("extra,says", [
    (["--presets", "tiny-dense,tiny-switchhead", "--baseline", "tiny-nope"],
     "--baseline tiny-nope is not among the presets of this sweep (tiny-dense, tiny-switchhead)"),
    (["--presets", " , "], "--presets needs at least one preset name, got ' , '"),
])
def test_sweep_arguments_that_cannot_give_a_table_are_refused(extra, says, tmp_path, capsys):
    assert main(["sweep", "--out", str(tmp_path / "o"), "--budgets", "2", *extra]) == 2
    msg = one_line_error(capsys, "sweep")
    assert says in msg and "context lengths" not in msg
    assert not (tmp_path / "o").exists()  # nothing trained, nothing written


# ------------------------------------------------- 11: "No space left on device" names the path

def _fsync_full_under(monkeypatch, root: Path) -> None:
    """fsync of a file under ``root`` fails with ENOSPC, as it does when the disk is full and
    the data was only buffered."""
    real = os.fsync

    def fsync(fd):
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            where = ""
        if where.startswith(str(root)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_full_cache_disk_names_the_cache_file(tmp_path, capsys, monkeypatch):
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc")
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(cache))
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat.\n" * 200)
    _fsync_full_under(monkeypatch, cache)
    assert main(["train", "--preset", "tiny-dense", "--data", str(tmp_path / "corpus.txt"),
                 "--steps", "1", "--out", str(tmp_path / "run"), *TINY_TRAIN]) == 2
    msg = one_line_error(capsys, "train")
    assert f"{cache}/" in msg and "the disk is full" in msg
    assert ".tmp" not in msg.split(":")[1]  # the cache entry, not a private temporary name


def test_a_full_disk_under_harness_out_names_the_file(tiny_run, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    harness_offline(monkeypatch, tmp_path)
    data = tmp_path / "data"
    (data / "lambada").mkdir(parents=True)
    (data / "lambada" / "lambada_test.jsonl").write_text(
        json.dumps({"text": "the cat sat on the mat"}) + "\n")
    res = tmp_path / "results" / "res.json"
    _fsync_full_under(monkeypatch, tmp_path / "results")
    capsys.readouterr()
    assert main(["eval", "--run", str(tiny_run), "--harness", "moeify_lambada", "--data-dir",
                 str(data), "--device", "cpu", "--harness-out", str(res)]) == 2
    assert f"{res}: the disk is full" in one_line_error(capsys, "eval")
    assert list((tmp_path / "results").iterdir()) == []


# ------------------------------------------------- 12: messages that say the right thing

@pytest.fixture
def gpt2_src(tmp_path):
    transformers = pytest.importorskip("transformers")
    from moeify.interop.hf_export import byte_level_tokenizer_json

    cfg = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    src = tmp_path / "src"
    model.save_pretrained(src)
    (src / "tokenizer.json").write_bytes(byte_level_tokenizer_json(range(256), unk=False))
    return src, model


def test_import_without_model_type_says_so(gpt2_src, tmp_path, capsys):
    src, _ = gpt2_src
    cfg = json.loads((src / "config.json").read_text())
    del cfg["model_type"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert main(["import", "--hf", str(src), "--out", str(tmp_path / "run")]) == 2
    msg = one_line_error(capsys, "import")
    assert 'has no "model_type"' in msg and 'add "model_type": "gpt2"' in msg
    assert "not supported" not in msg and not (tmp_path / "run").exists()


def test_import_of_nan_weights_blames_the_checkpoint_not_the_learning_rate(gpt2_src, tmp_path,
                                                                           capsys):
    import torch

    src, model = gpt2_src
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    model.save_pretrained(src)
    assert main(["import", "--hf", str(src), "--out", str(tmp_path / "run")]) == 2
    msg = one_line_error(capsys, "import")
    assert "weights hold NaN or inf values (transformer.h.0.mlp.c_fc.weight)" in msg
    assert "learning rate" not in msg and "damaged or was saved from a diverged model" in msg
    assert not (tmp_path / "run").exists()


# ------------------------------------------------- 13: the README's claims about sharded runs

def test_eval_harness_and_plot_read_a_sharded_only_run(tmp_path, capsys, monkeypatch):
    """README: `moeify eval --harness` and `moeify plot` read either kind of checkpoint. One
    process with parallel=fsdp writes sharded checkpoints."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    harness_offline(monkeypatch, tmp_path)
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat by the door.\n" * 100)
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny-switchall", "--data", str(tmp_path / "corpus.txt"),
                 "--steps", "2", "--out", str(run), "--set", "parallel=fsdp",
                 *[a for x in ("tokenizer=byte256", "model.d_model=16", "model.n_layers=1",
                               "model.context_length=16", "batch_size=2", "eval_every=0",
                               "eval_tokens=64") for a in ("--set", x)], "--quiet"]) == 0
    assert list(run.glob("checkpoints/step-*/dcp")) and not list(run.glob("**/model.safetensors"))
    data = tmp_path / "data"
    (data / "lambada").mkdir(parents=True)
    (data / "lambada" / "lambada_test.jsonl").write_text(
        json.dumps({"text": "the cat sat on the mat"}) + "\n")
    capsys.readouterr()
    res = tmp_path / "res.json"
    assert main(["eval", "--run", str(run), "--harness", "moeify_lambada", "--data-dir",
                 str(data), "--device", "cpu", "--harness-out", str(res)]) == 0
    assert json.loads(res.read_text())["results"]["moeify_lambada"]
    pytest.importorskip("matplotlib")
    capsys.readouterr()
    assert main(["plot", "experts", "--run", str(run), "--out", str(tmp_path / "e.png"),
                 "--tokens", "64"]) == 0
    assert (tmp_path / "e.png").stat().st_size > 0
    assert main(["plot", "attention", "--run", str(run), "--out", str(tmp_path / "a.png"),
                 "--text", "the cat"]) == 0
    assert (tmp_path / "a.png").stat().st_size > 0


def test_compare_with_no_preset_names_says_so(tmp_path, capsys):
    assert main(["compare", "--out", str(tmp_path / "o"), "--presets", " , "]) == 2
    assert "--presets needs at least one preset name, got ' , '" in one_line_error(capsys,
                                                                                   "compare")
    assert not (tmp_path / "o").exists()
