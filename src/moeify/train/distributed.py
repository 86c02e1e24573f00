"""Data-parallel process group handling (torchrun; gloo on CPU, NCCL on CUDA).

The only place besides the trainer that touches torch.distributed: model code is written for one
device and data parallelism is applied from outside (docs/layout.md). A process group that the
caller already initialised (tests do, with torch.multiprocessing) is used as it is; otherwise
one is created when torchrun's WORLD_SIZE > 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class PeerLost(RuntimeError):
    """A collective failed because another process of the group is gone (killed, crashed): the
    transport error (gloo's "Connection closed by peer", NCCL's DistBackendError) as one type,
    so that the trainer can say what happened instead of a traceback."""

    def __init__(self, rank: int, world_size: int, what: str, detail: str) -> None:
        super().__init__(f"{what}: {detail}")
        self.rank, self.world_size, self.what, self.detail = rank, world_size, what, detail


def peer_lost_message(rank: int, world_size: int, during: str, intact: str | None,
                      run_dir) -> str:
    """The one line a surviving process prints when another one died during ``during``: which
    process died (named when there are two), which checkpoint is intact, how to resume."""
    other = f"process {1 - rank}" if world_size == 2 else "another process"
    kept = (f"checkpoint {intact} is intact" if intact is not None
            else "no checkpoint had been written yet")
    return (f"{other} of {world_size} stopped (killed or crashed) during {during}, so process "
            f"{rank} stops too; {kept}; resume with: torchrun --nproc-per-node {world_size} "
            f"-m moeify.cli.main train --resume {run_dir}")


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
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        return DistEnv(owns_group=True)
    dist.init_process_group(backend=backend)
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
