"""Kernel choice by measurement: the per-device tables that "auto" reads on CUDA.

A table is what ``moeify bench expert-matmul --preset-shapes --device cuda --write-table PATH``
measured on one device class: for each expert-matmul shape of the presets' layers, the
forward+backward time of every kernel that ran there. The committed tables live beside this
module (``tables/<class>.json``); ``MOEIFY_KERNEL_TABLE=PATH`` reads another one instead, on
every device (a table measured on your own device, CPU included).

Device classes: the CUDA device's name, "NVIDIA H100 ..." -> "h100", "NVIDIA H200 ..." ->
"h200"; any other device has no class.

The rule (``table_choice``): among the table's entries of the call's dtype and gating, the
nearest one whose shape is within reach of the call's (D, F, E and K each within a factor of 2,
the rows M within a factor of 8; distance = the sum of |log2| ratios of M, K, E, D, F); from it,
the fastest measured kernel that may run the call (available here, and, under torch.compile,
one a compiled graph runs). No table for the device, no entry within reach, or no measured
kernel that may run: None, and the policy's fallback rule decides (moeify.ops.moe.policy).

Shape legend: M rows, K experts per row, E experts, D input width, F output width.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Callable

import torch

TABLE_DIR = Path(__file__).resolve().parent / "tables"
# How far a call's shape may lie from a measured entry for that entry to decide (factors).
WIDTH_REACH = 2.0
ROWS_REACH = 8.0
CLASSES = {"H100": "h100", "H200": "h200"}


def class_of_name(name: str) -> str | None:
    """The device class of a CUDA device name (module docstring), or None."""
    for key, cls in CLASSES.items():
        if key in name.upper():
            return cls
    return None


@functools.lru_cache(maxsize=None)
def _device_class(index: int) -> str | None:
    return class_of_name(torch.cuda.get_device_name(index))


def device_class(device: torch.device) -> str | None:
    """The class of a CUDA device (module docstring); None for other devices."""
    if device.type != "cuda":
        return None
    return _device_class(device.index if device.index is not None else
                         torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the kernel table {path}: {e}; rewrite it with moeify "
                         "bench expert-matmul --preset-shapes --write-table, or unset "
                         "MOEIFY_KERNEL_TABLE") from None
    if not isinstance(table.get("entries"), list):
        raise ValueError(f"the kernel table {path} has no list of entries; rewrite it with "
                         "moeify bench expert-matmul --preset-shapes --write-table")
    return table


def load_table(cls: str | None) -> dict | None:
    """The table that decides for device class ``cls``: ``MOEIFY_KERNEL_TABLE`` if set, else the
    committed one of the class, else None."""
    override = os.environ.get("MOEIFY_KERNEL_TABLE")
    if override:
        return _read(override)
    if cls is None:
        return None
    path = TABLE_DIR / f"{cls}.json"
    return _read(str(path)) if path.is_file() else None


def _distance(entry: dict, shape: dict) -> float | None:
    """Sum of |log2| ratios over M, K, E, D, F, or None when out of reach."""
    total = 0.0
    for key in ("M", "K", "E", "D", "F"):
        a, b = max(entry[key], 1), max(shape[key], 1)
        r = abs(math.log2(a / b))
        if r > math.log2(ROWS_REACH if key == "M" else WIDTH_REACH):
            return None
        total += r
    return total


def ranking(table: dict, shape: dict, dtype: str, gated: bool) -> tuple[str, ...]:
    """The kernels of the nearest entry within reach of ``shape`` ({M, K, E, D, F}) for this
    dtype (e.g. "bfloat16") and gating, fastest first; () when none is within reach."""
    best = None
    for entry in table["entries"]:
        if entry.get("dtype") != dtype or bool(entry.get("gated", True)) != gated:
            continue
        d = _distance(entry, shape)
        if d is not None and (best is None or d < best[0]):
            best = (d, entry)
    if best is None:
        return ()
    return tuple(name for name, _ in sorted(best[1]["ms"].items(), key=lambda kv: kv[1]))


def table_choice(table: dict, shape: dict, dtype: torch.dtype, gated: bool,
                 may_run: Callable[[str], bool]) -> str | None:
    """The kernel the table picks for a call of ``shape`` ({M, K, E, D, F}), or None (module
    docstring). ``may_run(name)``: whether that kernel may run this call."""
    names = ranking(table, shape, str(dtype).removeprefix("torch."), gated)
    return next((name for name in names if may_run(name)), None)


@torch._dynamo.assume_constant_result
def device_ranking(device: str, dtype: str, gated: bool, M: int, K: int, E: int, D: int,
                   F: int) -> tuple[str, ...]:
    """``ranking`` from the table that decides on ``device`` (``load_table``), () without one.
    Plain values in and out, run as it is while torch.compile traces (the table's file and
    the device's name are read then, never traced): the graph keeps the kernel it names."""
    table = load_table(device_class(torch.device(device)))
    if table is None:
        return ()
    return ranking(table, dict(M=M, K=K, E=E, D=D, F=F), dtype, gated)


def table_entry(shape: dict, dtype: str, gated: bool, ms: dict[str, float], **extra) -> dict:
    """One measured entry of a table: the shape, the dtype, whether gated, the time of each
    kernel in milliseconds, and ``extra`` (the baselines, the contract)."""
    return dict({k: int(shape[k]) for k in ("M", "K", "E", "D", "F")}, dtype=dtype,
                gated=gated, ms={k: float(v) for k, v in ms.items()},
                fastest=min(ms, key=ms.get), **extra)


__all__ = ["CLASSES", "ROWS_REACH", "TABLE_DIR", "WIDTH_REACH", "class_of_name", "device_class",
           "device_ranking", "load_table", "ranking", "table_choice", "table_entry"]
