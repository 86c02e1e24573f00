"""The gloo process group a forked test worker runs in."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def gloo_group(rank: int, world: int, init_file):
    """Process ``rank`` of ``world`` in a gloo group that meets through ``init_file``, on one
    thread (the workers share the machine's cores); the group is destroyed on leaving, whatever
    happened inside."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
