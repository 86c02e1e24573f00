"""The meter of the cost contract (moeify.bench.contract): what one call or one training step
costs, counted at the dispatcher rather than timed.

What is counted, per case (a ``CostMeter`` around the call):

    macs      multiply-adds of the matrix products (the formulas of
              torch.utils.flop_counter: mm, addmm, bmm, baddbmm, attention; plus CPU flash
              attention and grouped_mm, which it lacks; FLOPs / 2), counted by the meter
              itself. A matrix-product operator with no formula fails the measurement rather
              than counting zero.
    ops       aten operators dispatched (TorchDispatchMode), per operator name; ``kernels``
              leaves out views and metadata-only operators: a proxy for GPU kernel launches.
    syncs     host read-backs: ``.item()`` and friends (``aten._local_scalar_dense``),
              ``.tolist()`` / ``.numpy()``, and the operators whose output size depends on the
              data (nonzero, masked_select, unique, bincount, boolean indexing,
              repeat_interleave without an output size), which read back on a GPU.
    allocated bytes (and count) of the tensor storages the call creates: every operator
              output that is not a view of an existing storage, plus a storage's growth by
              an ``out=`` resize.
    peak      the most bytes held at once by the storages created since the measurement
              began (a storage is freed when its last reference goes: CPython's reference
              counting, with the cyclic collector off while measuring).

Memory here is what the operators return, at the dispatcher: the scratch space a kernel
allocates inside itself (a BLAS packing buffer, a reduction's per-thread partials) is not
seen, which is what makes the count the same on every machine and thread count. The profiler
measurement of moeify.bench.memory sees those too (and is what ``bench step`` reports).

Fake tensors. Every count above depends on shapes only, unless the code reads data on the
host. Under torch's FakeTensorMode every operator runs its shape function alone (no
arithmetic, no memory), and the meter counts the same operators, MACs and bytes: a step case
with ``fake=True`` costs only its operators' dispatch, whatever the model's size, so the
whole 47M training step at the paper's batch (64 x 256 tokens) counts in seconds, where running
it takes minutes on two cores. A test holds a step counted both ways equal, field for field.
What cannot be counted so: a kernel that reads the routing on the host to size its work
("segment", "padded", "sets", hence CPU "auto"), which raises ``HostReadUnderFakeTensors``,
and "grouped" (torch's fake grouped_mm takes bfloat16 only); those run with real tensors on
two blocks and 32 tokens. The CPU check of expert ids reads them back; on fake tensors it is
the device-side assertion a GPU runs (moeify.ops.moe.plan.check_ids).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import re
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

aten = torch.ops.aten

# Operators whose output size depends on tensor values: a GPU must read back to size it.
_DATA_SIZED = {aten.nonzero, aten.masked_select, aten._unique2, aten.unique_dim,
               aten.unique_consecutive, aten.bincount, aten.nonzero_static}
# Operators that hand a value to the host.
_READ_BACKS = {aten._local_scalar_dense, aten.equal, aten.is_nonzero}
# Operators that move no data (besides views): not a kernel launch on a GPU.
_METADATA = {aten.detach, aten.alias, aten._unsafe_view, aten.lift_fresh, aten._local_scalar_dense,
             aten.promote_types,
             aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset,
             aten.is_same_size, aten.set_}
# A matrix product must have a MAC formula: one without would silently count zero.
_MATMUL_LIKE = re.compile(r"mm|matmul|dot|linear|conv|attention|einsum|addmv|\bmv\b|addr|ger")


def _grouped_mm_flops(a_shape, b_shape, offs_shape=None, bias_shape=None, out_dtype=None,
                      out_shape=None, **kwargs) -> int:
    """grouped_mm: [P, A] x [E, A, B] -> [P, B] (the forward), [A, P] x [P, B] -> [E, A, B]
    (the weight gradient, P split by the offsets), or one product per group of 3-D operands."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    raise ValueError(f"no MAC formula for grouped_mm of {a_shape} and {b_shape}")


def _addmm_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """addmm_ / baddbmm_ (in place): 2 m k n per product."""
    batch = a_shape[0] if len(a_shape) == 3 else 1
    return 2 * batch * a_shape[-2] * a_shape[-1] * b_shape[-1]


def _cpu_sdpa_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _cpu_sdpa_backward_flops(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


# FlopCounterMode's registry lacks CPU flash attention, grouped_mm and the in-place products.
EXTRA_FLOP_FORMULAS = {
    aten.addmm_: _addmm_flops,
    aten.baddbmm_: _addmm_flops,
    aten._grouped_mm: _grouped_mm_flops,
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
}


# Every formula, taking (*args, out_val=output, **kwargs) as FlopCounterMode calls them.
FLOP_FORMULAS = {**flop_registry, **{k: shape_wrapper(f) for k, f in EXTRA_FLOP_FORMULAS.items()}}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class CostMeter(TorchDispatchMode):
    """Counts operators, host read-backs and storage allocations (module docstring) while
    active; ``phase(name)`` opens a new set of counters, ``costs()`` returns them."""

    def __init__(self):
        super().__init__()
        self.live = 0  # bytes held by the storages created while measuring
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage -> bytes counted for it
        self._phases: dict[str, dict] = {}
        self._cur: dict | None = None
        self.phase("setup")

    def phase(self, name: str) -> None:
        self._cur = {"ops": collections.Counter(), "syncs": collections.Counter(), "kernels": 0,
                     "allocated": 0, "allocations": 0, "start": self.live, "top": self.live,
                     "flops": 0}
        self._phases[name] = self._cur

    def read_back(self, what: str) -> None:
        self._cur["syncs"][what] += 1

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _allocate(self, st, nbytes: int) -> None:
        key = st._cdata
        self._sizes[key] = self._sizes.get(key, 0) + nbytes
        if nbytes == self._sizes[key]:
            weakref.finalize(st, self._free, key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._cur["top"] = max(self._cur["top"], self.live)
        self._cur["allocated"] += nbytes
        self._cur["allocations"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if func.namespace in ("profiler", "prim"):  # record_function's markers: instrumentation;
            return func(*args, **kwargs)            # prim.device: fake tensors' metadata queries
        name = str(packet).removeprefix("aten.")
        formula = FLOP_FORMULAS.get(packet)
        if formula is None and _MATMUL_LIKE.search(name):
            raise RuntimeError(f"the cost contract has no MAC formula for {func}; add one to "
                               "moeify.bench.cost_meter.EXTRA_FLOP_FORMULAS")
        inputs = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))
                  if t.device.type != "meta"}
        out = func(*args, **kwargs)
        if formula is not None:
            self._cur["flops"] += formula(*args, **kwargs, out_val=out)
        self._cur["ops"][name] += 1
        if not (func.is_view or packet in _METADATA):
            self._cur["kernels"] += 1
        if packet in _READ_BACKS:
            self._cur["syncs"][name] += 1
        elif packet in _DATA_SIZED or (packet in (aten.index, aten.index_put, aten.index_put_)
                                       and any(t.dtype == torch.bool for t in _tensors(args[1]))):
            self._cur["syncs"][name] += 1
        # lift_fresh hands the dispatcher a tensor made outside it (torch.tensor of a Python
        # value), whose creation no operator reports: not counted (under fake tensors its
        # output is a new fake storage, with real ones the same storage).
        for t in _tensors(out) if packet is not aten.lift_fresh else ():
            st = t.untyped_storage()
            key, nbytes = st._cdata, st.nbytes()
            known = self._sizes.get(key)
            if known is None and key not in inputs:
                self._allocate(st, nbytes)
            elif known is not None and nbytes > known:  # grown by an out= resize
                self._allocate(st, nbytes - known)
        return out

    def costs(self) -> dict[str, dict]:
        out = {}
        for name, p in self._phases.items():
            ops = dict(sorted(p["ops"].items()))
            out[name] = {
                "ops": sum(ops.values()),
                "kernels": p["kernels"],
                "syncs": sum(p["syncs"].values()),
                "allocated": p["allocated"],
                "allocations": p["allocations"],
                "working": p["top"] - p["start"],
                "sync_ops": dict(sorted(p["syncs"].items())),
                "op_counts": ops,
                "macs": p["flops"] // 2,
            }
        return out


@contextlib.contextmanager
def _host_reads_raise(fake: bool):
    """Under fake tensors, a read of a value (FakeTensorMode's data-dependent-output errors)
    as ``HostReadUnderFakeTensors``, with what to do."""
    if not fake:
        yield
        return
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise HostReadUnderFakeTensors(
            f"this case reads tensor data on the host ({e}), which fake tensors do not "
            "have: count it with real tensors (Case(fake=False)) at a size that is fast "
            "enough") from None


@contextlib.contextmanager
def _counting_host_reads(meter: CostMeter):
    """``Tensor.tolist`` and ``Tensor.numpy`` counted as read-backs: on a CPU tensor they read
    memory without dispatching an operator."""
    saved = {n: getattr(torch.Tensor, n) for n in ("tolist", "numpy")}

    def wrap(n, f):
        def counted(self, *a, **kw):
            meter.read_back(n)
            return f(self, *a, **kw)
        return counted

    for n, f in saved.items():
        setattr(torch.Tensor, n, wrap(n, f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


class HostReadUnderFakeTensors(RuntimeError):
    """A case counted under fake tensors read a tensor's value on the host."""


@contextlib.contextmanager
def _fake_mode():
    """A FakeTensorMode in which every operator runs its shape function only (no arithmetic,
    no memory): an operator whose output size depends on the data, or a read of a value,
    raises. torch picks its foreach kernels (gradient clipping, the optimizer's fallback) only
    for tensors whose Python type it lists; FakeTensor joins those lists while the mode is on,
    so the same kernels are chosen as for real tensors."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    lists = [_foreach_utils._foreach_supported_types, optimizer._foreach_supported_types]
    for types in lists:
        types.append(FakeTensor)
    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            yield mode
    finally:
        for types in lists:
            types.remove(FakeTensor)


def measure(setup: Callable[[], dict[str, Callable[[], object]]], *,
            setup_counted: bool, fake: bool = False, threads: int = 2) -> dict:
    """Run ``setup()`` (which returns ordered phases, name -> callable) and every phase once
    under a CostMeter and FlopCounterMode. ``setup_counted``: whether the setup's storages
    count towards the memory (a training step's weights and optimizer state) or not (one
    layer's call: only what the call allocates). ``fake``: everything (the setup included)
    under fake tensors (``_fake_mode``): the same operators dispatched and counted, the same
    sizes allocated and freed, and no arithmetic, so a model of any size costs only its
    operators' dispatch; a case that reads data on the host raises
    ``HostReadUnderFakeTensors`` (``setup_counted`` only: a layer's inputs would be made
    outside the mode). Returns {"peak": bytes, "phases": {name: costs with "macs"}}."""
    if fake and not setup_counted:
        raise ValueError("fake=True counts the setup too: pass setup_counted=True")
    threads_was = torch.get_num_threads()
    gc_was = gc.isenabled()
    torch.set_num_threads(threads)
    gc.collect()
    gc.disable()
    try:
        phases = None if setup_counted else setup()
        meter = CostMeter()
        with (_fake_mode() if fake else contextlib.nullcontext()), meter, \
                _counting_host_reads(meter), _host_reads_raise(fake):
            if phases is None:
                phases = setup()
            for name, fn in phases.items():
                meter.phase(name)
                fn()
        costs = meter.costs()
        peak = meter.peak
        del phases, meter
    finally:
        if gc_was:
            gc.enable()
        torch.set_num_threads(threads_was)
    return {"peak": peak, "phases": costs}
