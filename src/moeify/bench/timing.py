"""Timing and reporting helpers shared by every ``moeify bench`` command."""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time
from typing import Callable

import torch

from moeify.ops.moe import TRACE_PREFIX


def _sync(device: torch.device | str | None) -> None:
    if _is_cuda(device):
        torch.cuda.synchronize(device)


def _is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _timed_call(fn: Callable[[], object], device) -> float:
    """Seconds one call of ``fn`` takes. On CUDA: between two CUDA events recorded on the
    current stream around the call, after the work queued before it has finished (the GPU's
    time for the call, launch gaps included, no host-side synchronisation cost); elsewhere the
    wall time."""
    if _is_cuda(device):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def release_cached_memory(device: torch.device | str | None = None) -> None:
    """Return this process's cached CUDA blocks to the driver (after a ``gc.collect()`` frees
    what only cycles held), so that a fresh process measuring memory on the same GPU finds it
    free. Nothing to do off CUDA or before CUDA was used."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _no_gc():
    """The garbage collector off while timing (as ``timeit`` does): a collection pass landing in
    one case's call would be charged to that case alone."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def interleaved_median_times(fns: dict[str, Callable[[], object]], *, warmup: int = 2,
                             repeats: int = 7, device=None,
                             cpu_times: dict | None = None) -> dict[str, float]:
    """Median times of several functions measured side by side: every repeat runs each function
    once in turn, so a noisy neighbour slows all of them alike and the ratios stay meaningful.
    ``cpu_times``: a dict to fill with the median CPU time of this process per call (all its
    threads), which on an oversubscribed machine does not count the time spent waiting for a
    core, unlike the wall time (work with fewer parallel regions waits less there)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    with _no_gc():
        for _ in range(repeats):
            for name, fn in fns.items():
                c0 = time.process_time()
                times[name].append(_timed_call(fn, device))
                cpu[name].append(time.process_time() - c0)
    if cpu_times is not None:
        cpu_times.update({name: statistics.median(ts) for name, ts in cpu.items()})
    return {name: statistics.median(ts) for name, ts in times.items()}


def format_table(rows: list[dict], columns: list[str]) -> str:
    """A plain aligned text table of ``rows`` (dicts) over ``columns``."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return "-" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def emit(result: dict, table: str, as_json: bool) -> None:
    print(json.dumps(result, indent=2) if as_json else table)


def expert_impls_run(fn: Callable[[], object]) -> list[str]:
    """The expert-matmul implementations one call of ``fn`` really ran, sorted: read from the
    profiler ranges that ``moeify.ops.moe.expert_matmul`` names after the kernel."""
    from torch.profiler import ProfilerActivity, profile  # only benchmarks that trace need it

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.name[len(TRACE_PREFIX):] for e in prof.events()
                   if e.name.startswith(TRACE_PREFIX)})


def kernel_profile(fn: Callable[[], object], device=None, *, top: int = 8) -> dict:
    """Where one call of ``fn`` spends its time, by kernel, from ``torch.profiler`` (run it
    warm: the call's first run compiles and autotunes). On CUDA the device kernels (Triton's
    by their function name, cuBLAS's, the elementwise ones), timed on the GPU; elsewhere the
    operations' self CPU time. Returns ``counted`` ("kernels" or "operations"), ``launches``
    (how many ran),
    ``total_us`` (their summed time) and the ``top`` entries by time: name, calls, µs, share."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = _is_cuda(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
        else:
            if e.name.startswith(TRACE_PREFIX) or e.self_cpu_time_total <= 0:
                continue
            us = e.self_cpu_time_total
        by_name.setdefault(e.name, []).append(us)
    total = sum(sum(v) for v in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "counted": "kernels" if cuda else "operations",
        "timer": "GPU time of each kernel" if cuda else "CPU self time of each operation",
        "launches": sum(len(v) for v in by_name.values()),
        "total_us": total,
        "top": [{"kernel": name if len(name) <= 72 else name[:69] + "...", "calls": len(v),
                 "us": round(sum(v)), "share": sum(v) / total if total else 0.0}
                for name, v in ranked],
    }
