"""The cost contract: what a layer or a training step costs, counted rather than timed.

Timings on a shared CPU swing by +-12% run to run, so a change that adds a GEMM, a copy or a
host read-back hides in them. These counts do not move: for one call (or one training step)
they are a function of the code, the shapes and the seeded routing, on any machine, with or
without a GPU. ``moeify bench contract`` prints them; ``--write`` regenerates the committed
expectations (tests/bench/contract_expectations.json), which tests/bench/test_contract.py holds
every case to, exactly.

What is counted, and how: moeify.bench.cost_meter (MACs, operators and kernels, host
read-backs, bytes allocated, peak memory; fake tensors).

Cases (``CASES``): the attention layer of the SwitchHead 47M and 262M presets and of their
dense baselines, fwd+bwd (layer_phases: weights and inputs excluded from the memory), and
47M training steps (step_phases: forward, backward, clipping, AdamW; the memory counts
everything from before the model is built, the costs are the second step's, after AdamW's
state exists). The SwitchHead layers run once per expert kernel (``KERNELS``): "auto" and every
registered kernel that runs on CPU tensors ("segment"; "grouped": torch's grouped GEMM;
"concat": one dense GEMM over every expert, gated, recomputing its intermediate in the
backward; "concat_saved": the same, keeping it; "padded"; "sets"), all forced by name.
"triton" runs on the CPU only in Triton's interpreter, far too slow at these shapes, and is
left out; "reference", "gather", "pairs" and "all" are test and decoding paths. Shapes: one
sequence for the layers, 64 queries (128 keys with the XL memory). The steps: the whole 47M
models at batch 64 and the preset's 256 tokens under fake tensors, dense and SwitchHead with
"concat" and "concat_saved" (``FULL_STEP_KERNELS``); and the first two blocks on one sequence
of 32 tokens with real tensors for "auto" and "grouped" (``STEP_KERNELS``; their dense
baseline counted fake). Every width, head and expert count is the preset's. The 262M step
counts under fake tensors too (``Case("step", "wt103-262m-switchhead", 64, 512, "concat",
fake=True)``), in about three times the 47M step's time: not among the cases the tests run.

Measured with float32, ``THREADS`` intra-op threads (the CPU policy of "auto" reads the thread
count) and the cases' fixed seeds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from moeify.bench.attention import layer_phases
from moeify.bench.cost_meter import measure
from moeify.bench.step import step_phases
from moeify.bench.timing import format_table
from moeify.layers.attention import DenseAttentionConfig
from moeify.models.config import ModelConfig
from moeify.models.presets import get_preset
from moeify.ops.moe.cpu.sets import MAX_SETS, n_sets

aten = torch.ops.aten
_MIB = 1024 * 1024

# The intra-op threads the cases run with: "auto"'s CPU policy pads only with several threads.
THREADS = 2
# Expert kernels of the SwitchHead cases (module docstring).
KERNELS = ("auto", "segment", "grouped", "concat", "concat_saved", "padded", "sets")
EXPECTATIONS = Path("tests") / "bench" / "contract_expectations.json"

# ------------------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Case:
    """One contract case: a preset's attention layer (fwd+bwd) or its training step at a
    chunk of ``T`` tokens and ``batch`` sequences, with the SwitchHead layers' expert kernel
    forced (None: a dense model); ``dense``: the case its ratios are to; ``fake``: counted
    under fake tensors (``measure``; steps only)."""

    kind: str  # "layer" or "step"
    preset: str
    batch: int
    T: int
    kernel: str | None = None
    dense: str | None = None
    blocks: int | None = None  # the preset's first blocks only (None: all)
    fake: bool = False

    @property
    def name(self) -> str:
        return " ".join([self.kind, self.preset] + ([self.kernel] if self.kernel else [])
                        + [f"b{self.batch}", f"T{self.T}"]
                        + ([f"L{self.blocks}"] if self.blocks else [])
                        + (["fake"] if self.fake else []))

    def config(self) -> ModelConfig:
        cfg = dataclasses.replace(get_preset(self.preset), context_length=self.T)
        if self.blocks:
            L = self.blocks
            cfg = dataclasses.replace(
                cfg, n_layers=L, depth=cfg.depth[:L],
                **{name: tuple(dataclasses.replace(a, n_layers=L) for a in getattr(cfg, name)[:L])
                   for name in ("attention", "feedforward")})
        if self.kernel is None:
            return cfg
        att = tuple(a if isinstance(a, DenseAttentionConfig) else
                    dataclasses.replace(a, expert_impl=self.kernel) for a in cfg.attention)
        return dataclasses.replace(cfg, attention=att)


def _kernels_for(preset: str) -> tuple[str, ...]:
    """KERNELS, less "sets" where the layout does not apply (more than MAX_SETS expert sets
    per head: 262M's C(8, 4) = 70; forced, it allocates 3 GiB for one layer)."""
    a = get_preset(preset).attention_layers()[0]
    return tuple(k for k in KERNELS if k != "sets" or n_sets(a.n_experts, a.k) <= MAX_SETS)


def _cases() -> list[Case]:
    out = []
    for size in ("47m", "262m"):
        dense, sh = f"wt103-{size}-dense", f"wt103-{size}-switchhead"
        out.append(Case("layer", dense, LAYER_BATCH, LAYER_T))
        out += [Case("layer", sh, LAYER_BATCH, LAYER_T, k, dense) for k in _kernels_for(sh)]
    dense, sh = "wt103-47m-dense", "wt103-47m-switchhead"
    # The dense step under fake tensors, which count what real ones do (a test holds them
    # equal on a smaller step: tests/bench/test_contract.py), in a tenth of the time.
    out.append(Case("step", dense, STEP_BATCH, STEP_T, blocks=STEP_BLOCKS, fake=True))
    out += [Case("step", sh, STEP_BATCH, STEP_T, k, dense, STEP_BLOCKS) for k in STEP_KERNELS]
    for size in FULL_STEP_SIZES:
        dense, sh = f"wt103-{size}-dense", f"wt103-{size}-switchhead"
        T = get_preset(dense).context_length
        out.append(Case("step", dense, FULL_STEP_BATCH, T, fake=True))
        out += [Case("step", sh, FULL_STEP_BATCH, T, k, dense, fake=True)
                for k in FULL_STEP_KERNELS]
    return out


# Shapes (module docstring): short chunks keep the whole contract to seconds on two cores;
# every width, head and expert count is the preset's.
LAYER_BATCH, LAYER_T = 1, 64
STEP_BATCH, STEP_T, STEP_BLOCKS = 1, 32, 2
# The steps run "auto" (the CPU's choice) and "grouped" (the CUDA one); every kernel's own
# costs are the layers'.
STEP_KERNELS = ("auto", "grouped")
# The whole models' steps at the paper's training shape (batch 64, the preset's context),
# counted under fake tensors (module docstring): the kernels that read nothing on the host.
FULL_STEP_SIZES = ("47m",)
FULL_STEP_BATCH = 64
FULL_STEP_KERNELS = ("concat", "concat_saved")
CASES = _cases()
FIELDS = ("macs", "kernels", "ops", "syncs", "allocated", "allocations", "working", "peak")


def run_case(case: Case) -> dict:
    """The case's costs: the measured phase's counters, MACs and memory (module docstring)."""
    cfg_json = case.config().to_json()
    if case.kind == "layer":
        if case.fake:
            raise ValueError("a layer case is counted with real tensors (fake=False)")
        res = measure(lambda: {"fwd+bwd": layer_phases(cfg_json, batch=case.batch)["fwd+bwd"]},
                      setup_counted=False, threads=THREADS)
        costs = res["phases"]["fwd+bwd"]
    elif case.kind == "step":
        res = measure(lambda: step_phases(cfg_json, batch=case.batch, steps=2),
                      setup_counted=True, fake=case.fake, threads=THREADS)
        costs = res["phases"]["step 2"]
    else:
        raise ValueError(f"unknown contract case kind {case.kind!r}")
    costs = dict(costs, peak=res["peak"])
    return {k: costs[k] for k in FIELDS + ("sync_ops", "op_counts")}


def bench_contract(cases=None) -> dict:
    """Every case's costs ({"cases": {name: costs}}), with its ratios to its dense case."""
    cases = CASES if cases is None else cases
    out = {name: run_case(c) for name, c in ((c.name, c) for c in cases)}
    names = {(c.kind, c.preset, c.batch, c.T, c.blocks): c.name for c in cases}
    for c in cases:
        base = names.get((c.kind, c.dense, c.batch, c.T, c.blocks))
        if base is not None:
            out[c.name]["vs dense"] = {k: out[c.name][k] / out[base][k]
                                       for k in ("macs", "peak") if out[base][k]}
    return {"bench": "contract", "threads": THREADS, "dtype": "float32",
            "torch": torch.__version__.split("+")[0], "cases": out}


def table(result: dict) -> str:
    rows = []
    for name, c in result["cases"].items():
        vs = c.get("vs dense", {})
        rows.append({"case": name, "MACs": c["macs"], "kernels": c["kernels"], "ops": c["ops"],
                     "syncs": c["syncs"], "alloc MiB": c["allocated"] / _MIB,
                     "allocs": c["allocations"], "peak MiB": c["peak"] / _MIB,
                     "MACs x": vs.get("macs"), "peak x": vs.get("peak")})
    head = (f"cost contract: float32, {result['threads']} threads, torch {result['torch']}; "
            "layers fwd+bwd (memory: what the call allocates), steps: the second training step "
            "(peak: everything since before the model was built); x = ratio to the dense case")
    return head + "\n" + format_table(rows, list(rows[0]) if rows else [])


def expectations_path(root: Path | None = None) -> Path:
    return (root or Path.cwd()) / EXPECTATIONS


def write_expectations(result: dict, path: Path) -> None:
    """The committed expectations, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def differences(expected: dict, got: dict) -> list[str]:
    """One line per count that differs between two cases' costs (empty: equal)."""
    out = []
    for k in FIELDS:
        if expected.get(k) != got.get(k):
            out.append(f"{k}: {expected.get(k)} -> {got.get(k)}")
    for k in ("sync_ops", "op_counts"):
        a, b = expected.get(k, {}), got.get(k, {})
        out += [f"{k}[{op}]: {a.get(op, 0)} -> {b.get(op, 0)}"
                for op in sorted(set(a) | set(b)) if a.get(op, 0) != b.get(op, 0)]
    return out
