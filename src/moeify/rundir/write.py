"""Writing single-file checkpoints that survive a crash at any moment: atomic, verified, and
checked against the run. Reading them (``load_checkpoint``, ``latest_checkpoint``, ...) is
moeify.rundir.checkpoints'; sharded checkpoints are moeify.rundir.sharded's. Training,
importing (moeify.interop) and upcycling all write runs here, without importing train.

Layout inside a run directory (moeify.rundir.layout):

    checkpoints/
        step-00000100/            one complete checkpoint
            model.safetensors     model weights (safetensors: no code runs when it is loaded)
            state.pt              optimizer, scheduler, grad scaler, data position, RNG states,
                                  XL memory (loaded with torch.load(weights_only=True))
            meta.json             step, model config, sha256 of both files; written last
        latest                    the name of the newest complete checkpoint

A checkpoint is written into a private temporary directory, every file fsynced, then renamed to
its final name in one step, and only then does ``latest`` (itself replaced atomically) point at
it. A process killed at any point therefore leaves the previous checkpoint and pointer intact;
a failed write (a full disk, a read-only file system, Ctrl-C) removes its temporary directory
at once, and temporary entries left by killed processes (``.tmp-*-PID`` whose PID is no longer
running) are swept by the next save; those of a live process are never touched. Older complete
checkpoints beyond ``keep`` are deleted only after the new one is in place.

A checkpoint holds only finite numbers: ``save_checkpoint`` refuses weights or optimizer state
with a NaN or infinity (NonFiniteState) and ``moeify.rundir.checkpoints.load_checkpoint``
refuses to load one, so a run never resumes, evaluates or samples from a diverged state.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from moeify.errors import describe_os_error
from moeify.rundir.atomic import fsync_path, sha256_file, write_bytes_atomic, write_json_atomic
from moeify.rundir.checkpoints import check_finite
from moeify.rundir.layout import (CHECKPOINTS, FORMAT_VERSION, LATEST, META_FILE, MODEL_FILE,
                                  STATE_FILE, checkpoint_dirs, checkpoint_name, step_of)
from moeify.data.cache import pid_alive


# ---------------------------------------------------------------------- saving

class _Writer:
    """A binary file that remembers the OSError a write raised: torch.save reports a failed
    write of a file object as its own RuntimeError, and this is how the real cause (a full
    disk, a read-only file system) and the file's name come back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as e:
            if e.filename is None:
                e.filename = str(self.path)
            self.error = e
            raise

    def flush(self) -> None:
        self.file.flush()

    def __enter__(self) -> "_Writer":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.file.close()  # flushing the last buffer can be what hits the full disk
        except OSError as e:
            if exc[0] is None:
                raise
            self.error = self.error or e


def _open_for_write(path: Path) -> _Writer:
    """Every checkpoint byte goes through here, so disk errors are OSErrors naming the file."""
    return _Writer(path)


def _save_model(state: dict[str, torch.Tensor], path: Path, step: int) -> None:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    data = save(tensors, metadata={"format": "moeify", "step": str(step)})
    with _open_for_write(path) as f:
        f.write(data)


def save_state(state: dict[str, Any], path: Path) -> None:
    """torch.save into ``path``; a failed write is the OSError that caused it (naming the
    file), not torch's own RuntimeError."""
    with _open_for_write(path) as f:
        try:
            torch.save(state, f)
        except RuntimeError:
            if f.error is not None:
                raise f.error from None
            raise


def write_failure(step: int, e: BaseException) -> str | None:
    """The one line for a checkpoint write that failed on an operating-system error (a full
    disk, a read-only file system), found among the exception's causes (torch and DCP wrap
    it); None when no OSError caused it. Single-file and sharded checkpoints say it alike."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError):
            return f"writing checkpoint step {step} failed: {describe_os_error(seen)}"
        for inner in getattr(seen, "failures", {}).values():  # DCP's CheckpointException
            if isinstance(inner, tuple):  # (exception, traceback)
                inner = inner[0]
            found = write_failure(step, inner) if isinstance(inner, BaseException) else None
            if found:
                return found
        seen = seen.__cause__ or seen.__context__
    return None


DIVERGED_ADVICE = "the weights diverged: lower the learning rate or grad_clip, or train in fp32"


def save_checkpoint(run_dir: str | Path, step: int, model_state: dict[str, torch.Tensor],
                    train_state: dict[str, Any], *, meta: dict[str, Any] | None = None,
                    keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically and point ``latest`` at it; returns its directory.

    Raises NonFiniteState (nothing written) when a weight or optimizer tensor is not finite,
    and OSError when the disk refuses the write (the temporary directory is removed, the
    previous checkpoint and ``latest`` are untouched)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    check_finite(model_state, train_state, f"checkpoint step {step} was not written",
                 DIVERGED_ADVICE)
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    sweep_stale(root)
    name = checkpoint_name(step)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    try:
        _write_checkpoint_dir(tmp, step, model_state, train_state, meta)
    except BaseException:  # a full disk, Ctrl-C, ...: leave no partial directory behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish_checkpoint(tmp, name, keep=keep)


def publish_checkpoint(tmp: Path, name: str, *, keep: int) -> Path:
    """Rename the complete, fsynced temporary checkpoint directory ``tmp`` (inside
    ``checkpoints/``) to ``name`` in one step, point ``latest`` at it and prune; returns it.
    Shared by the single-file and the sharded (moeify.rundir.sharded) checkpoints."""
    root = tmp.parent
    final = root / name
    if final.exists():  # a checkpoint of the same step from an abandoned continuation
        old = root / f".old-{name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_path(root)
    write_bytes_atomic(root / LATEST, (name + "\n").encode())
    _prune(root, keep, current=final)
    return final


def _write_checkpoint_dir(tmp: Path, step: int, model_state: dict[str, torch.Tensor],
                          train_state: dict[str, Any], meta: dict[str, Any] | None) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    _save_model(model_state, tmp / MODEL_FILE, step)
    save_state(train_state, tmp / STATE_FILE)
    for f in (MODEL_FILE, STATE_FILE):
        fsync_path(tmp / f)
    record = {"format": FORMAT_VERSION, "step": step, **(meta or {}),
              "sha256": {f: sha256_file(tmp / f) for f in (MODEL_FILE, STATE_FILE)}}
    write_json_atomic(tmp / META_FILE, record)
    fsync_path(tmp)


def _owner_pid(name: str) -> int | None:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def sweep_stale(root: Path) -> list[Path]:
    """Remove temporary checkpoint entries (``.tmp-*-PID``, ``.old-*-PID``, ``.latest.tmp-PID``)
    of processes that are no longer running, or of this one; returns what was removed."""
    removed = []
    for p in list(root.glob(".tmp-*")) + list(root.glob(".old-*")) + list(root.glob(".*.tmp-*")):
        pid = _owner_pid(p.name)
        if pid is None or (pid != os.getpid() and pid_alive(pid)):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def _remove_checkpoint(p: Path) -> None:
    """Rename a checkpoint out of the readers' sight (``.old-NAME-PID``, which sweep_stale
    removes once this process is gone), then delete it: a kill half-way through the deletion
    leaves no hollow ``step-N`` directory behind."""
    old = p.with_name(f".old-{p.name}-{os.getpid()}")
    try:
        os.replace(p, old)
    except OSError:
        return
    shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep: int, current: Path) -> None:
    sweep_stale(root)
    # Checkpoints newer than the one just written belong to a continuation that was abandoned
    # when the run was resumed from an earlier checkpoint.
    step = step_of(current)
    older = []
    for p in checkpoint_dirs(root.parent):
        if p == current:
            continue
        if step_of(p) > step:
            _remove_checkpoint(p)
        else:
            older.append(p)
    for p in older[: max(0, len(older) - (keep - 1))]:
        _remove_checkpoint(p)


def set_aside(ckpt: Path) -> Path:
    """Rename a checkpoint whose weights proved unusable to ``diverged-step-N`` (kept for
    inspection, ignored by every reader) and point ``latest`` back at the newest remaining
    one (or remove ``latest`` when none remains)."""
    root = ckpt.parent
    aside = root / f"diverged-{ckpt.name}"
    if aside.exists():
        shutil.rmtree(aside)
    os.replace(ckpt, aside)
    remaining = checkpoint_dirs(root.parent)
    if remaining:
        write_bytes_atomic(root / LATEST, (remaining[-1].name + "\n").encode())
    else:
        (root / LATEST).unlink(missing_ok=True)
    fsync_path(root)
    return aside
