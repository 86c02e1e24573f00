"""Peak memory of a benchmark case, measured in a fresh process.

A case is named by a factory, ``"module:function"``, called with JSON keyword arguments in a new
Python process (``python -m moeify.bench.memory SPEC``). The factory builds what it needs and
returns its phases, an ordered dict of name -> callable. Each phase runs once; its peak is the
most memory held at any point up to the end of that phase, minus the baseline:

    CPU   the process's peak resident set: VmHWM of /proc/self/status on Linux (ru_maxrss
          elsewhere; on Linux ru_maxrss would start at the parent's resident set, which exec
          carries over). A fresh process is needed because that peak never goes down. Under
          ``moeify`` the process runs with glibc malloc settings that keep freed memory
          (moeify.cli.main), so the resident set follows the allocator's peak rather than the
          OS's page recycling.
    CUDA  ``torch.cuda.max_memory_allocated`` (tensors only, not the caching allocator's slack).

The baseline is taken either after the factory returned (``baseline="after_setup"``: weights
and inputs excluded, e.g. one attention layer's activations and gradients) or before the
factory ran (``"before_setup"``: everything the case allocates, e.g. a whole training step with
its weights, gradients and optimizer state). Phases run in order, so a later phase's peak is the
maximum over it and every earlier one.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import subprocess
import sys

import torch

_MIB = 1024 * 1024


def _maxrss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def _resolve(factory: str):
    module, _, name = factory.partition(":")
    if not module or not name:
        raise ValueError(f"a memory-case factory is named 'module:function', got {factory!r}")
    return getattr(importlib.import_module(module), name)


def run_phases(factory: str, kwargs: dict, *, device: str = "cpu",
               baseline: str = "after_setup") -> dict[str, float]:
    """Run the case in this process and return each phase's peak in MiB (see module docstring).
    Meaningful on CPU only in a process that has not run anything large before."""
    if baseline not in ("after_setup", "before_setup"):
        raise ValueError(f"baseline must be 'after_setup' or 'before_setup', got {baseline!r}")
    fn = _resolve(factory)
    cuda = torch.device(device).type == "cuda"

    def now() -> int:
        return torch.cuda.memory_allocated(device) if cuda else _maxrss_bytes()

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = now()
    phases = fn(**kwargs)
    if baseline == "after_setup":
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        base = now()
    out = {}
    for name, phase in phases.items():
        phase()
        if cuda:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = _maxrss_bytes()
        out[name] = max(0, peak - base) / _MIB
    return out


def peak_memory(factory: str, kwargs: dict, *, device: str = "cpu",
                baseline: str = "after_setup", threads: int | None = None,
                timeout: float = 1800.0) -> dict[str, float]:
    """Each phase's peak memory in MiB, measured in a fresh Python process (inheriting this
    one's environment, hence the CLI's malloc settings)."""
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
