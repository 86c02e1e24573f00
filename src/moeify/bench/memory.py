"""Peak memory of a benchmark case, measured in a fresh process.

A case is named by a factory, ``"module:function"``, called with JSON keyword arguments in a new
Python process (``python -m moeify.bench.memory SPEC``). The factory builds what it needs and
returns its phases, an ordered dict of name -> callable, each run once. Memory is the memory
held by tensors, as the allocator sees it:

    CPU   torch.profiler's memory events (``profile_memory=True``): every allocation and free
          the CPU allocator reports, at its own time, summed into a timeline (kernels' scratch
          buffers included). Deterministic, unlike the process's resident set,
          which also holds the allocator's slack and moves with heap fragmentation from run to
          run (measured: +-7% on a whole training step).
    CUDA  ``torch.cuda.memory_allocated`` / ``max_memory_allocated``.

For every phase two numbers, in MiB:

    peak     the most memory held at any point up to the end of the phase, above the baseline;
    working  the most memory held during the phase above what was held when it started (what
             the phase itself needs on top of the state it inherits).

The baseline is taken either after the factory returned (``baseline="after_setup"``: weights
and inputs excluded, e.g. one attention layer's activations and gradients) or before the
factory ran (``"before_setup"``: everything the case allocates, e.g. a whole training step with
its weights, gradients and optimizer state).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import torch

from moeify.bench.timing import release_cached_memory

_MIB = 1024 * 1024
_MARK = "moeify.bench.phase."


def _resolve(factory: str):
    module, _, name = factory.partition(":")
    if not module or not name:
        raise ValueError(f"a memory-case factory is named 'module:function', got {factory!r}")
    return getattr(importlib.import_module(module), name)


def _allocations(prof) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """The CPU allocator's events of a profile, in order: (time ns, bytes; negative for a
    free), and the start times of the phase markers by name."""
    from torch._C._profiler import _EventType

    allocs, marks = [], {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        kind, fields = e.typed
        if kind == _EventType.Allocation and fields.device.type == "cpu":
            allocs.append((e.start_time_ns, fields.alloc_size))
        elif e.name.startswith(_MARK):
            marks[e.name[len(_MARK):]] = e.start_time_ns
        stack.extend(e.children)
    allocs.sort()
    return allocs, marks


def _cpu_phases(fn, kwargs: dict, before_setup: bool) -> dict[str, dict[str, float]]:
    from torch.profiler import ProfilerActivity, profile, record_function

    phases = None if before_setup else fn(**kwargs)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if phases is None:
            phases = fn(**kwargs)
        names = list(phases)
        for i, name in enumerate(names):
            with record_function(f"{_MARK}{i}.start"):
                pass
            phases[name]()
            with record_function(f"{_MARK}{i}.end"):
                pass
    # Every allocation and free at its own time, as the allocator reported it. (Summing each
    # operator's net allocation instead would book the frees made by Python inside a range,
    # e.g. a custom autograd Function's temporaries, at the range's end, after allocations
    # that really came later: peaks that never were.)
    deltas, marks = _allocations(prof)
    out, held, peak_all, j = {}, 0, 0, 0
    for i, name in enumerate(names):
        start, end = marks[f"{i}.start"], marks[f"{i}.end"]
        while j < len(deltas) and deltas[j][0] < start:
            held += deltas[j][1]
            peak_all = max(peak_all, held)
            j += 1
        at_start, top = held, held
        while j < len(deltas) and deltas[j][0] <= end:
            held += deltas[j][1]
            top = max(top, held)
            j += 1
        peak_all = max(peak_all, top)
        out[name] = {"peak": max(0, peak_all) / _MIB, "working": max(0, top - at_start) / _MIB}
    return out


def _cuda_phases(fn, kwargs: dict, before_setup: bool, device) -> dict[str, dict[str, float]]:
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    phases = fn(**kwargs)
    torch.cuda.synchronize(device)
    if not before_setup:
        base = torch.cuda.memory_allocated(device)
    peak_all = torch.cuda.memory_allocated(device) - base
    out = {}
    for name, phase in phases.items():
        torch.cuda.reset_peak_memory_stats(device)
        at_start = torch.cuda.memory_allocated(device)
        phase()
        torch.cuda.synchronize(device)
        top = torch.cuda.max_memory_allocated(device)
        peak_all = max(peak_all, top - base)
        out[name] = {"peak": max(0, peak_all) / _MIB,
                     "working": max(0, top - at_start) / _MIB}
    return out


def run_phases(factory: str, kwargs: dict, *, device: str = "cpu",
               baseline: str = "after_setup") -> dict[str, dict[str, float]]:
    """Run the case in this process: {phase: {"peak": MiB, "working": MiB}} (module
    docstring). On CUDA a fresh process keeps other work's cached blocks out of the numbers."""
    if baseline not in ("after_setup", "before_setup"):
        raise ValueError(f"baseline must be 'after_setup' or 'before_setup', got {baseline!r}")
    fn = _resolve(factory)
    if torch.device(device).type == "cuda":
        return _cuda_phases(fn, kwargs, baseline == "before_setup", device)
    return _cpu_phases(fn, kwargs, baseline == "before_setup")


def peak_memory(factory: str, kwargs: dict, *, device: str = "cpu",
                baseline: str = "after_setup", threads: int | None = None,
                timeout: float = 1800.0) -> dict[str, dict[str, float]]:
    """``run_phases`` in a fresh Python process (inheriting this one's environment). On CUDA
    this process first hands its cached blocks back (``release_cached_memory``): the fresh
    process shares the GPU with it, and a parent that timed a large model could otherwise hold
    most of the GPU's memory in its allocator's cache."""
    if torch.device(device).type == "cuda":
        release_cached_memory(device)
    spec = {"factory": factory, "kwargs": kwargs, "device": str(device), "baseline": baseline,
            "threads": threads or torch.get_num_threads()}
    r = subprocess.run([sys.executable, "-m", "moeify.bench.memory", json.dumps(spec)],
                       capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    if r.returncode != 0:
        raise RuntimeError(f"the memory measurement of {factory} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    torch.set_num_threads(int(spec["threads"]))
    out = run_phases(spec["factory"], spec["kwargs"], device=spec["device"],
                     baseline=spec["baseline"])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
