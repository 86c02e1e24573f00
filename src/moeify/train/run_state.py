"""The unsharded part of a training checkpoint (``state.pt``): what the next update reads besides
the weights and the optimizer, gathered from every process when saving and handed back to each
when resuming. The schedule position, the grad scaler, the data position, every process's RNG
state and the XL memory of every row: with them a resumed run repeats the uninterrupted run's
losses bit for bit on the same hardware and process count."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random-number generators (torch, the device's, Python's, numpy's)."""
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "mps": torch.mps.get_rng_state() if device.type == "mps" else None,
            "python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                      int(np_state[2]), int(np_state[3]), float(np_state[4])]}


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if state.get("mps") is not None and device.type == "mps":
        torch.mps.set_rng_state(state["mps"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))


def gather_state(tr) -> dict[str, Any] | None:
    """Collective: the training state of trainer ``tr`` (moeify.train.trainer.Trainer), every
    process's RNG and memory rows included; the dict on process 0, None elsewhere."""
    rngs = tr.env.all_gather_object(rng_state(tr.device))
    mem_local = None if tr.memory is None else [m.detach().cpu() for m in tr.memory]
    mems = tr.env.all_gather_object(mem_local)
    if not tr.env.is_main:
        return None
    memory = None if any(m is None for m in mems) else [
        torch.cat([m[i] for m in mems], 0) for i in range(len(mems[0]))]
    return {"step": tr.step, "scheduler": tr.scheduler.state_dict(),
            "scaler": tr.scaler.state_dict() if tr.scaler.is_enabled() else {},
            "data": tr.batcher.state_dict(), "rng": rngs, "memory": memory,
            "tokens_seen": tr.tokens_seen, "world_size": tr.env.world_size}


def apply_state(tr, st: dict[str, Any], factor: float) -> None:
    """Put the training state ``st`` back into trainer ``tr`` (this process's rows of it);
    ``factor``: the schedule's factor at the checkpoint's step under this run's schedule.
    KeyError, ValueError, RuntimeError, TypeError for a state that does not fit."""
    if "optimizer" in st:
        tr.optimizer.load_state_dict(st["optimizer"])
    tr.scheduler.load_state_dict(st["scheduler"])
    # The optimizer's state holds the rate the old schedule set for the next update; this run's
    # schedule (changed by resume_schedule, or the same) decides it.
    for group, base in zip(tr.optimizer.param_groups, tr.scheduler.base_lrs):
        group["lr"] = base * factor
    tr.scheduler._last_lr = [g["lr"] for g in tr.optimizer.param_groups]
    if tr.scaler.is_enabled() and st.get("scaler"):
        tr.scaler.load_state_dict(st["scaler"])
    tr.batcher.load_state_dict(st["data"])
    rngs = st["rng"]
    set_rng_state(rngs[tr.env.rank % len(rngs)], tr.device)
    mem = st.get("memory")
    if mem is not None:
        lo = tr.env.rank * tr.rows
        tr.memory = [m[lo:lo + tr.rows].to(tr.device) for m in mem]
    tr.step = int(st["step"])
    tr.tokens_seen = int(st.get("tokens_seen", 0))
