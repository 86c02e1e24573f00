"""Where a call's time goes, operation by operation: every ATen operation it dispatches, timed
as it runs (a ``TorchDispatchMode``), summed by operation and input shapes.

``torch.profiler`` is the usual tool, but on a 2-core CPU it distorts exactly what is asked
here: it adds half again to a SwitchHead layer's forward+backward and charges most of the extra
to the batched matmuls. Timed one by one, the operations' sum stays close to the call's untimed
time (3-10% above it for the 47M attention layers, dense and SwitchHead alike); it leaves out
the Python between the operations, and the timer's own bookkeeping makes the wall time under
it ("wall ms") much longer than either.

The operations split into GEMMs (``GEMM_OPS``) and the rest (gathers, sums, softmax, copies,
...). Used by ``moeify bench attention --ops N``.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMM_OPS = frozenset({"mm", "bmm", "addmm", "addmm_", "baddbmm", "addbmm", "_grouped_mm",
                      "addmv", "mv", "dot"})


class OpTimer(TorchDispatchMode):
    """Accumulates the wall time of every dispatched operation: ``times[(name, shapes)]``
    seconds and ``calls[(name, shapes)]``, shapes being those of the tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.times: dict[tuple, float] = defaultdict(float)
        self.calls: dict[tuple, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter() - t0
        key = (func.overloadpacket.__name__,
               tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        self.times[key] += dt
        self.calls[key] += 1
        return out


def op_times(fn, *, repeats: int = 3, top: int = 10) -> dict:
    """Time ``fn()`` ``repeats`` times under an ``OpTimer`` (after one untimed call). Per call,
    in milliseconds: "wall" (under the timer), "ops" (the operations' sum), "gemm" and "other"
    (its two parts), and the ``top`` operations by time as {"op", "shapes", "ms", "calls"}."""
    if repeats < 1 or top < 0:
        raise ValueError("repeats must be positive and top non-negative")
    fn()
    timer = OpTimer()
    t0 = time.perf_counter()
    with timer:
        for _ in range(repeats):
            fn()
    wall = time.perf_counter() - t0
    per = 1e3 / repeats
    gemm = sum(t for (name, _), t in timer.times.items() if name in GEMM_OPS)
    total = sum(timer.times.values())
    ranked = sorted(timer.times.items(), key=lambda kv: -kv[1])[:top]
    return {"wall ms": wall * per, "ops ms": total * per, "gemm ms": gemm * per,
            "other ms": (total - gemm) * per,
            "top": [{"op": name, "shapes": [list(s) for s in shapes], "ms": t * per,
                     "calls": timer.calls[(name, shapes)] / repeats}
                    for (name, shapes), t in ranked]}


__all__ = ["GEMM_OPS", "OpTimer", "op_times"]
