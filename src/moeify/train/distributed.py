"""Data-parallel process group handling (torchrun; gloo on CPU, NCCL on CUDA).

Model code is written for one device and parallelism is applied from outside (the plans of
moeify.train.plans). One process group per process: ``process_group`` (a context the command
line opens once around a whole command) creates it from torchrun's environment and destroys it
at the end; a Trainer uses the group it finds and never destroys one it did not create, so a
command that runs two trainers in turn (``--init-from``: a step-0 run, then its training) never
initialises a group twice. A process group the caller initialised (tests do, with
torch.multiprocessing) is used as it is.

No collective waits forever: the groups moeify creates (and the sub-groups of their device
meshes) time out after ``MOEIFY_COLLECTIVE_TIMEOUT`` seconds (default 600), and a collective that
times out or loses its peer ends in one line naming this process, what it was doing and the
latest complete checkpoint (``collective_failure``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeify.errors import MoeifyError


class PeerLost(RuntimeError):
    """A collective failed because another process of the group is gone (killed, crashed): the
    transport error (gloo's "Connection closed by peer", NCCL's DistBackendError) as one type,
    so that the trainer can say what happened instead of a traceback."""

    def __init__(self, rank: int, world_size: int, what: str, detail: str) -> None:
        super().__init__(f"{what}: {detail}")
        self.rank, self.world_size, self.what, self.detail = rank, world_size, what, detail


def resume_command(run_dir, world_size: int) -> str:
    """The command that resumes ``run_dir`` with the process count it ran with."""
    if world_size > 1:
        return (f"torchrun --nproc-per-node {world_size} -m moeify.cli.main train --resume "
                f"{run_dir}")
    return f"moeify train --resume {run_dir}"


def peer_lost_message(rank: int, world_size: int, during: str, intact: str | None,
                      run_dir) -> str:
    """The one line a surviving process prints when another one died during ``during``: which
    process died (named when there are two), which checkpoint is intact, how to resume."""
    other = f"process {1 - rank}" if world_size == 2 else "another process"
    kept = (f"checkpoint {intact} is intact" if intact is not None
            else "no checkpoint had been written yet")
    return (f"{other} of {world_size} stopped (killed or crashed) during {during}, so process "
            f"{rank} stops too; {kept}; resume with: {resume_command(run_dir, world_size)}")


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _is_transport_error(e: BaseException) -> bool:
    """An error of the process group's transport (a peer that is gone), raised by a collective
    inside torch (FSDP, DCP, expert parallelism's all-to-all) or by DistEnv's helpers."""
    backend_error = getattr(dist, "DistBackendError", ())
    text = str(e)
    return isinstance(e, PeerLost) or bool(backend_error and isinstance(e, backend_error)) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "gloo",
                            "Broken pipe"))


def collective_failure(e: BaseException, env: "DistEnv", during: str, run_dir) -> str | None:
    """The one line for a collective that failed during ``during`` because another process died
    (or hung past the timeout), naming the latest complete checkpoint of ``run_dir`` on disk;
    None when ``e`` is no such failure (or the run has one process)."""
    from moeify.rundir.layout import latest_checkpoint

    if not env.enabled or not (_is_timeout(e) or _is_transport_error(e)):
        return None
    latest = latest_checkpoint(run_dir) if Path(run_dir).is_dir() else None
    if _is_timeout(e):
        kept = (f"checkpoint {latest} is intact" if latest is not None
                else "no checkpoint had been written yet")
        return (f"process {env.rank} of {env.world_size} waited more than {collective_timeout()} s "
                f"for the others during {during} (MOEIFY_COLLECTIVE_TIMEOUT), so it stops; a "
                f"process is stuck or gone; {kept}; resume with: "
                f"{resume_command(run_dir, env.world_size)}")
    return peer_lost_message(env.rank, env.world_size, during, latest, run_dir)


def exit_at(point: str, rank: int) -> None:
    """Faults made deterministic for tests. ``MOEIFY_EXIT_AT=RANK:POINT`` makes process RANK
    exit at once (as ``kill -9`` would: no cleanup, exit status 137) when it reaches POINT;
    ``MOEIFY_STALL_AT=RANK:POINT`` makes it wait there (as a stuck process would) for three
    collective timeouts, then exit so. Points: ``step-N`` (step N done, before anything else),
    ``checkpoint-N`` (a process other than 0, just before it learns whether process 0 wrote
    checkpoint N). Unset, they cost two lookups."""
    here = f"{rank}:{point}"
    if os.environ.get("MOEIFY_STALL_AT") == here:
        import time

        time.sleep(3 * collective_timeout())
        os._exit(137)
    if os.environ.get("MOEIFY_EXIT_AT") == here:
        os._exit(137)


def collective_timeout() -> int:
    """Seconds a collective may wait (``MOEIFY_COLLECTIVE_TIMEOUT``, default 600)."""
    raw = os.environ.get("MOEIFY_COLLECTIVE_TIMEOUT", "600")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"MOEIFY_COLLECTIVE_TIMEOUT={raw!r} must be a whole number of seconds "
                         "above 0")
    return value


def _init_group(backend: str, **kw) -> None:
    timeout = datetime.timedelta(seconds=collective_timeout())
    # Sub-groups (a device mesh's "dp" and "ep" groups) take torch's module default, not the
    # world group's timeout: set it too, so that they time out alike.
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    dist.init_process_group(backend=backend, timeout=timeout, **kw)


def device_type(spec: str) -> str:
    """"cuda" or "cpu": the kind of device setting ``spec`` (auto, cpu, cuda:N, ...) trains on,
    which picks the process group's backend."""
    import torch

    return "cuda" if spec.startswith("cuda") or (spec == "auto" and torch.cuda.is_available()) \
        else "cpu"


@contextlib.contextmanager
def process_group(device_type: str):
    """The process group of a command run by torchrun (WORLD_SIZE > 1), created on entry and
    destroyed on exit; nothing when there is one process or a group already exists."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or not dist.is_available() or dist.is_initialized():
        yield
        return
    _init_group("nccl" if device_type == "cuda" else "gloo")
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ collectives
    # With one process every helper is the identity, so the trainer has a single code path.

    # A collective that fails because a peer is gone raises PeerLost.

    def _collective(self, what: str, fn) -> Any:
        try:
            return fn()
        except RuntimeError as e:  # gloo's and NCCL's errors (DistBackendError) are these
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PeerLost(self.rank, self.world_size, what, detail) from e

    def all_reduce_mean_(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            self._collective("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM))
            t.div_(self.world_size)
        return t

    def all_reduce_sum_(self, t: torch.Tensor, group=None) -> torch.Tensor:
        if self.enabled:
            self._collective("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM,
                                                                    group=group))
        return t

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._collective("all_gather_object", lambda: dist.all_gather_object(out, obj))
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        self._collective("broadcast_object", lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            self._collective("barrier", dist.barrier)

    def rank0_first(self, fn):
        """Run ``fn`` on process 0 first (it fills the caches), then on the others. When it
        fails on process 0 every process raises, instead of the others waiting forever."""
        if not self.enabled:
            return fn()
        out, error, exc = None, None, None
        if self.is_main:
            try:
                out = fn()
            except Exception as e:  # re-raised below, after telling the other processes
                error, exc = str(e), e
        error = self.broadcast_object(error)
        if exc is not None:
            raise exc
        if error is not None:
            raise MoeifyError(f"process 0 failed while preparing the data: {error}")
        return out if self.is_main else fn()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def setup_distributed(device_type: str, *, single: bool = False) -> DistEnv:
    """The process group of this run: an existing one, one from torchrun's environment, or none.
    ``single``: make a one-process group when there is none (FSDP2 needs a device mesh even on
    one device); it is never used for communication."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        return DistEnv(rank, world, int(os.environ.get("LOCAL_RANK", rank)), owns_group=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not single:
        return DistEnv()
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 or parallel=fsdp, but this torch build has no "
                           "torch.distributed")
    backend = "nccl" if device_type == "cuda" else "gloo"
    if world <= 1:
        _init_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return DistEnv(owns_group=True)
    _init_group(backend)
    return DistEnv(dist.get_rank(), dist.get_world_size(),
                   int(os.environ.get("LOCAL_RANK", "0")), owns_group=True)


def mps_available() -> bool:
    """Whether this torch build has Apple's Metal (MPS) backend and the machine can use it."""
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def pick_device(spec: str, env: DistEnv) -> torch.device:
    """``auto``: CUDA (this process's local rank) when available, else CPU. ``mps`` (Apple
    GPUs) is used only when asked for: not every operation moeify runs has an MPS kernel."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", env.local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"device {spec!r} is not a torch device: use auto, cpu, cuda, cuda:N "
                         "or mps") from None
    if device.type == "mps":
        if not mps_available():
            raise ValueError(f"device={spec} was requested but this torch has no usable MPS "
                             "backend (it needs Apple silicon and a macOS build of torch): use "
                             "device=cpu (or auto)")
        return device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {spec!r} is not supported: use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device=cuda was requested but CUDA is not available: use "
                             "device=cpu (or auto)")
        if device.index is None:
            device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return device


def cpu_threads_for_load(cores: int, load: float) -> int:
    """Intra-op threads for CPU work: the cores the 1-minute load average leaves free, at least
    one. OpenMP threads wait for each other at every parallel region, so a thread whose core is
    busy with another process stalls all of them: on 2 cores under a load of 7, one tiny-
    switchhead training step took 8.0 s with 2 threads and 1.2 s with 1."""
    return max(1, min(cores, cores - int(load)))


def configure_cpu_threads() -> int | None:
    """Set torch's CPU thread count from the machine's load, unless the user chose one with
    OMP_NUM_THREADS (torchrun sets it too). Returns the count set, or None when left alone."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    n = cpu_threads_for_load(cores, load)
    torch.set_num_threads(n)
    return n
