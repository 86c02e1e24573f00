"""Sharded checkpoints (torch.distributed.checkpoint, "DCP"): every process writes its own shards.

Layout, beside the single-file checkpoints of moeify.rundir.write (same ``checkpoints/``
directory, same ``latest`` pointer, same pruning):

    checkpoints/step-00000100/
        dcp/              DCP: .metadata plus one __<rank>_0.distcp file per writing process,
                          holding the model weights ("model.*") and the AdamW state ("optim.*")
                          by parameter name, as ``get_state_dict`` gives them
        state.pt          what is not sharded: scheduler, grad scaler, data position, every
                          process's RNG state, the XL memory of every row, the step
        meta.json         "kind": "sharded", the step, the model config, the world size and the
                          sha256 of every file above; written last

Atomic at the directory level, like the single-file checkpoints: all processes write into one
temporary directory (its name chosen by process 0 and broadcast), process 0 adds state.pt and
meta.json once every shard is on disk, fsyncs, and renames the directory to its final name in
one step (``publish_checkpoint``). A process killed at any point leaves the previous checkpoint
and ``latest`` intact; the next save removes the half-written directory. A write that fails
(a full disk, Ctrl-C) removes its temporary directory at once. As for single-file checkpoints,
only finite numbers are written: every process checks its own shards of the weights and AdamW
state before anything is written, and all of them refuse the checkpoint when any shard holds a
NaN or an infinity (NonFiniteState).

DCP stores each tensor with its global shape and the offsets of every shard, so a checkpoint
written by W processes loads into any number of processes, sharded or not: ``restore_sharded``
resumes training; moeify.rundir.checkpoints reads them for everything else
(``load_sharded_weights`` fills a plain one-device model, ``load_model_checkpoint`` does that
for either kind of checkpoint). Expert-parallel runs (moeify.train.expert_parallel) write these
too: their expert weights are Shard(0) DTensors over the "ep" mesh dimension, stored by global
shape and offsets like FSDP's shards, so they load at another expert-parallel degree as well.
With several nodes the run directory must be on a filesystem every node sees. A checkpoint
written before a layer renamed a parameter (moeify.layers.common: the naming convention) holds
it, and its AdamW state, under the earlier name: loading reads it under that name
(``moeify.rundir.checkpoints.load_dcp``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch

from moeify.errors import MoeifyError
from moeify.rundir.atomic import fsync_path, sha256_file, write_json_atomic
from moeify.rundir.checkpoints import load_dcp, nonfinite_state, refuse_nonfinite, verify_sharded
from moeify.rundir.layout import (CHECKPOINTS, DCP_DIR, FORMAT_VERSION, META_FILE, SHARDED_KIND,
                                  STATE_FILE, checkpoint_name)
from moeify.rundir import write as ck


class Collectives(Protocol):
    """What the sharded writer needs of the run's process group (moeify.train.distributed's
    DistEnv is one): every method is collective, the identity with one process."""

    @property
    def is_main(self) -> bool: ...

    def broadcast_object(self, obj: Any) -> Any: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


def _dcp():
    # torch.distributed.checkpoint is imported only when a sharded run saves or resumes: it is
    # slow to import and absent from torch builds without distributed support.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


def _files(ckpt: Path) -> list[str]:
    """The files a sharded checkpoint's checksums cover, relative to it (meta.json excluded)."""
    found = [STATE_FILE] + [f"{DCP_DIR}/{p.name}" for p in sorted((ckpt / DCP_DIR).iterdir())]
    return [f for f in found if (ckpt / f).is_file()]


# ---------------------------------------------------------------------- saving

def save_sharded(env: Collectives, run_dir: Path, step: int, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, train_state: dict[str, Any] | None, *,
                 meta: dict[str, Any], keep: int) -> Path:
    """Collective: write checkpoint ``step`` (module docstring). ``train_state`` (the unsharded
    part) is used on process 0 only. Raises NonFiniteState on every process (nothing written)
    when a weight or AdamW tensor of any process's shards is not finite, and MoeifyError on
    every process when a write fails (the temporary directory is removed)."""
    dcp, get_state_dict, _ = _dcp()
    # get_state_dict gives an optimizer that has not stepped yet a state by stepping it once
    # with lr 0 (torch's _init_optim_state): AdamW's step count becomes 1, and a run resumed
    # from it would use another bias correction than a fresh one. Recorded, and undone on load.
    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if fresh:
        meta = {**meta, "optimizer_fresh": True}
    _check_finite_shards(env, model_sd, optim_sd, step)
    root = Path(run_dir) / CHECKPOINTS
    name = checkpoint_name(step)
    tmp, error = None, None
    if env.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            ck.sweep_stale(root)  # what killed writers left (never a live process's entries)
            tmp = root / f".tmp-{name}-{os.getpid()}"
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / DCP_DIR).mkdir(parents=True)
        except OSError as e:
            error = ck.write_failure(step, e)
    tmp, error = env.broadcast_object((tmp, error))
    _raise_if(error, step, run_dir)
    try:
        return _write_and_publish(env, dcp, tmp, name, step, model_sd, optim_sd, train_state,
                                  meta, keep, run_dir)
    except BaseException:  # a failed write, Ctrl-C, ...: leave no partial directory behind
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _local(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by this process's shard of it (no communication)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local(v) for v in obj)
    return obj


def _check_finite_shards(env: Collectives, model_sd: dict[str, Any], optim_sd: dict[str, Any],
                         step: int) -> None:
    """Collective: every process checks its own shards and all of them learn every bad name,
    so all raise NonFiniteState together (or none does)."""
    bad = nonfinite_state(_local(model_sd), {"optimizer": _local(optim_sd)})
    everywhere = list(dict.fromkeys(n for names in env.all_gather_object(bad) for n in names))
    refuse_nonfinite(everywhere, f"sharded checkpoint step {step} was not written",
                        ck.DIVERGED_ADVICE)


class ShardedWriteFailed(MoeifyError):
    """Writing a sharded checkpoint failed (raised on every process, the temporary directory
    removed, the previous checkpoint intact and still the latest)."""


def _write_and_publish(env: Collectives, dcp, tmp: Path, name: str, step: int, model_sd, optim_sd,
                       train_state, meta, keep: int, run_dir: Path) -> Path:
    """Collective: every process writes its shards into ``tmp``; process 0 then finishes and
    publishes it. An error on any process is raised on every process."""
    error, final = None, None
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR))
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException, on every process
        error = ck.write_failure(step, e) or (str(e).strip().splitlines()[0] if str(e).strip()
                                              else type(e).__name__)
    # Every process learns the first failure (a full disk may be seen by one process only).
    errors = [x for x in env.all_gather_object(error) if x is not None]
    error = next((x for x in errors if x.startswith("writing checkpoint")),
                 errors[0] if errors else None)
    _raise_if(error, step, run_dir)
    if env.is_main:
        try:
            final = _finish(tmp, name, step, train_state, meta, keep)
        except OSError as e:
            error = ck.write_failure(step, e)
    error = env.broadcast_object(error)
    _raise_if(error, step, run_dir)
    return final if final is not None else Path(run_dir) / CHECKPOINTS / name


def _finish(tmp: Path, name: str, step: int, train_state, meta, keep: int) -> Path:
    """Process 0, every shard on disk: the unsharded state, checksums, meta.json, publish."""
    ck.save_state(train_state, tmp / STATE_FILE)  # a full disk is an OSError naming the file
    files = _files(tmp)
    for f in files:
        fsync_path(tmp / f)
    fsync_path(tmp / DCP_DIR)
    record = {"format": FORMAT_VERSION, "kind": SHARDED_KIND, "step": step, **meta,
              "sha256": {f: sha256_file(tmp / f) for f in files}}
    write_json_atomic(tmp / META_FILE, record)
    fsync_path(tmp)
    return ck.publish_checkpoint(tmp, name, keep=keep)


def _raise_if(error: str | None, step: int, run_dir: Path) -> None:
    """Raise ShardedWriteFailed for ``error``: the one line of an operating-system error
    (``write_failure``, as single-file checkpoints say it), or another failure's first line."""
    if error is not None:
        if not error.startswith("writing checkpoint"):
            error = f"writing sharded checkpoint step {step} in {run_dir} failed: {error}"
        raise ShardedWriteFailed(error)


# ---------------------------------------------------------------------- loading

def restore_sharded(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    model_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load weights and AdamW state into ``model`` / ``optimizer`` (sharded or not, any number
    of processes; collective when sharded) and return the unsharded training state."""
    _, get_state_dict, set_state_dict = _dcp()
    meta = verify_sharded(ckpt, model_config=model_config)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    load_dcp(ckpt, state, model)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    if meta.get("optimizer_fresh"):  # written before the first step (save_sharded)
        optimizer.state.clear()
    try:
        return torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors come in many types
        raise MoeifyError(f"checkpoint {ckpt} is corrupt: {STATE_FILE} cannot be read ({e})") \
            from None


def holds_weights(env: Collectives, ckpt: Path, model: torch.nn.Module) -> bool:
    """Collective: whether the sharded checkpoint ``ckpt`` holds exactly ``model``'s current
    weights; every process compares its own shards, and all of them return the same answer."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    now = get_model_state_dict(model)
    saved = {k: torch.empty_like(v) for k, v in now.items()}
    try:
        load_dcp(ckpt, {"model": saved}, model)
        same = all(torch.equal(_local(saved[k]), _local(v.detach())) for k, v in now.items())
    except MoeifyError:
        same = False
    return all(env.all_gather_object(same))
