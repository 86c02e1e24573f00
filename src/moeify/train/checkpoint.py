"""Checkpoints that survive a crash at any moment: atomic, verified, and checked against the run.

Layout inside a run directory:

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
with a NaN or infinity (NonFiniteState) and ``load_checkpoint`` refuses to load one, so a run
never resumes, evaluates or samples from a diverged state.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeify.errors import MoeifyError, read_utf8
from moeify.train.lock import pid_alive

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
FORMAT_VERSION = 1


class NonFiniteState(MoeifyError):
    """Weights or optimizer state hold a NaN or an infinity."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    train_state: dict[str, Any]
    meta: dict[str, Any]


# ---------------------------------------------------------------------- durable writes

def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory entry's) data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync, and os.replace."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_path(path.parent)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2) + "\n").encode())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    from safetensors.torch import save

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    data = save(tensors, metadata={"format": "moeify", "step": str(step)})
    with _open_for_write(path) as f:
        f.write(data)


def _save_state(state: dict[str, Any], path: Path) -> None:
    with _open_for_write(path) as f:
        try:
            torch.save(state, f)
        except RuntimeError:
            if f.error is not None:
                raise f.error from None
            raise


def nonfinite_tensors(obj: Any, prefix: str = "") -> list[str]:
    """Names of the floating-point tensors in a (nested) state that hold a NaN or infinity."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            return [] if bool(torch.isfinite(obj).all()) else [prefix or "tensor"]
        return []
    if isinstance(obj, float):
        return [] if obj == obj and abs(obj) != float("inf") else [prefix or "value"]
    items = (obj.items() if isinstance(obj, dict)
             else enumerate(obj) if isinstance(obj, (list, tuple)) else ())
    out: list[str] = []
    for k, v in items:
        out += nonfinite_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    return out


DIVERGED_ADVICE = "the weights diverged: lower the learning rate or grad_clip, or train in fp32"


def nonfinite_state(model_state: dict[str, torch.Tensor],
                    train_state: dict[str, Any]) -> list[str]:
    """Names of the non-finite weights and optimizer tensors ("optimizer ..." for the latter)."""
    return nonfinite_tensors(model_state) + [
        f"optimizer {n}" for n in nonfinite_tensors(train_state.get("optimizer", {}))]


def check_finite(model_state: dict[str, torch.Tensor], train_state: dict[str, Any],
                 where: str, advice: str) -> None:
    """Raise NonFiniteState naming the first bad tensors of the weights or optimizer state."""
    refuse_nonfinite(nonfinite_state(model_state, train_state), where, advice)


def refuse_nonfinite(bad: list[str], where: str, advice: str) -> None:
    """Raise NonFiniteState naming the first of the tensors ``bad`` (nothing when empty)."""
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise NonFiniteState(f"{where}: non-finite values (NaN or inf) in "
                             f"{', '.join(bad[:3])}{more}; {advice}")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


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
    Shared by the single-file and the sharded (moeify.train.sharded) checkpoints."""
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
    _save_state(train_state, tmp / STATE_FILE)
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


def step_of(path: Path) -> int:
    """The step number of a checkpoint directory (step-00000100 -> 100)."""
    return int(path.name.split("-", 1)[1])


# ---------------------------------------------------------------------- finding

def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.glob("step-*"):
        try:
            step = int(p.name.split("-", 1)[1])
        except ValueError:
            continue
        if (p / META_FILE).is_file():
            found.append((step, p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, else the newest complete one, else None."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if target.is_dir() and target.parent == root:
            return target
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from either a checkpoint directory or a run directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: give a run directory (runs/NAME) or one "
                                "of its checkpoints (runs/NAME/checkpoints/step-...)")
    if (path / META_FILE).is_file() or path.parent.name == CHECKPOINTS:
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise MoeifyError(f"{path} holds no complete checkpoint (no {CHECKPOINTS}/step-*/"
                          f"{META_FILE}); train first, or point at the right run directory")
    return found


def run_dir_of(checkpoint: Path) -> Path:
    return checkpoint.parent.parent


# ---------------------------------------------------------------------- loading

def read_meta(ckpt: Path) -> dict[str, Any]:
    meta_path = ckpt / META_FILE
    try:
        meta = json.loads(read_utf8(meta_path))
        if not isinstance(meta, dict) or "step" not in meta or "sha256" not in meta:
            raise ValueError("step or sha256 missing")
    except FileNotFoundError:
        raise MoeifyError(f"checkpoint {ckpt} is incomplete: {META_FILE} is missing (a write was "
                          "interrupted); use an earlier checkpoint") from None
    except (OSError, ValueError) as e:
        raise MoeifyError(f"checkpoint {ckpt} is corrupt: {META_FILE} cannot be read ({e}); use "
                          "an earlier checkpoint") from None
    return meta


def load_checkpoint(path: str | Path, *, model_config: dict[str, Any] | None = None,
                    map_location: str | torch.device = "cpu") -> Checkpoint:
    """Load and verify a checkpoint (directory or run directory).

    ``model_config``: the ModelConfig dict of the model it is loaded into; a checkpoint written
    for another model (another preset or other overrides) is refused with a clear message."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    if meta.get("format") != FORMAT_VERSION:
        raise MoeifyError(f"checkpoint {ckpt} has format {meta.get('format')!r}; this moeify "
                          f"reads format {FORMAT_VERSION}")
    if model_config is not None and meta.get("model_config") != model_config:
        raise MoeifyError(f"checkpoint {ckpt} is from another model (preset "
                          f"{meta.get('preset')!r}): {_config_diff(meta.get('model_config'), model_config)}. "
                          "Load it with its own run's configuration, or start a new run")
    for f in (MODEL_FILE, STATE_FILE):
        p = ckpt / f
        if not p.is_file():
            raise MoeifyError(f"checkpoint {ckpt} is incomplete: {f} is missing; use an earlier "
                              "checkpoint")
        want = meta["sha256"].get(f)
        if want is not None and sha256_file(p) != want:
            raise MoeifyError(f"checkpoint {ckpt} is corrupt: {f} does not match the checksum "
                              f"recorded when it was written; use an earlier checkpoint "
                              f"({CHECKPOINTS}/step-...) or retrain")
    try:
        from safetensors.torch import load_file

        model_state = load_file(str(ckpt / MODEL_FILE), device=str(map_location))
    except Exception as e:  # safetensors raises its own error types on malformed files
        raise MoeifyError(f"checkpoint {ckpt} is corrupt: {MODEL_FILE} cannot be read ({e})") \
            from None
    try:
        train_state = torch.load(ckpt / STATE_FILE, map_location=map_location, weights_only=True)
    except Exception as e:  # unpickling errors come in many types
        raise MoeifyError(f"checkpoint {ckpt} is corrupt: {STATE_FILE} cannot be read ({e})") \
            from None
    if isinstance(train_state, dict):
        check_finite(model_state, train_state, f"checkpoint {ckpt} cannot be used",
                     "the run had diverged when it was written; use an earlier checkpoint")
    return Checkpoint(path=ckpt, step=int(meta["step"]), model_state=model_state,
                      train_state=train_state, meta=meta)


def load_model_state(model: torch.nn.Module, ckpt: Checkpoint) -> None:
    """Copy the checkpoint's weights into ``model``, with a clear error when they do not fit."""
    try:
        model.load_state_dict(ckpt.model_state, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise MoeifyError(f"checkpoint {ckpt.path} does not fit this model (it is from another "
                          f"preset or configuration): {' '.join(first[:3])}") from None


def _config_diff(saved: Any, wanted: Any) -> str:
    if not isinstance(saved, dict) or not isinstance(wanted, dict):
        return "the checkpoint records no model configuration"
    keys = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
    parts = []
    for k in keys[:4]:
        a, b = saved.get(k), wanted.get(k)
        if isinstance(a, (dict, list)) or isinstance(b, (dict, list)):
            parts.append(f"{k} differs")
        else:
            parts.append(f"{k} {a!r} in the checkpoint vs {b!r} here")
    return "; ".join(parts)
