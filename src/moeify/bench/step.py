"""Benchmark of a whole training step (forward, backward, clipping, optimizer) of full models,
side by side: time and peak memory, with the cost-accounting MAC ratios beside them.

Shape legend: B batch, T chunk length, V vocabulary, D d_model.

The step is the paper's recipe (SwitchHead appendix) on random tokens: training mode (dropout on),
one chunk of XL memory for XL models (computed once at setup, the same for every step), the LM
loss plus any auxiliary losses (the model called as the trainer calls it, without logits),
backward, gradient clipping at 0.1, the trainer's AdamW (``moeify.ops.optim.adamw``, lr 2.5e-4,
betas 0.9 / 0.999, no weight decay). Times are medians of interleaved repeats; with bfloat16 or
float16 the forward runs under autocast (no loss scaling: this is a timing).

Memory is tensor memory, measured in a fresh process (``moeify.bench.memory``) over two steps
(the first allocates the optimizer state): "peak" counts everything from before the model is
built (weights, gradients, the AdamW state, the XL memory, activations and temporaries); "step"
is what the second step needs on top of the state it inherits (weights, AdamW state, XL
memory): activations, gradients and temporaries. At batch 4 the inherited state is a large,
model-independent share of the peak, which pulls the peak ratio towards 1.

MAC columns (per sequence, forward): "attn MACs x" sums the attention layers' MACs of
moeify.models.cost;
"model MACs x" adds the dense feedforward (2·d·d_ff·T per layer) and the output layer (d·V·T),
and is left empty for models whose feedforward has no formula here (MoE feedforwards).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from moeify.bench.attention import (
    autocast_for,
    dense_baseline_for,
    omp_wait_policy,
    resolve_cases,
)
from moeify.bench.memory import peak_memory
from moeify.bench.timing import format_table, interleaved_median_times
from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.feedforward import DenseFFConfig
from moeify.models.config import ModelConfig
from moeify.models.cost import model_cost
from moeify.ops.optim import adamw

DEFAULT_STEP_PRESETS = ("wt103-47m-dense", "wt103-47m-switchhead", "wt103-47m-moa-h4")
GRAD_CLIP = 0.1  # κ of the small models (SwitchHead appendix)
LR = 2.5e-4


# torch.compile modes of the compiled rows, and the suffix of each row's name: "default"
# (inductor's kernels) and "reduce-overhead" (also CUDA graphs: a step's launches replayed as
# one graph; on the CPU the same as "default").
COMPILE_MODES = {"default": " compiled", "reduce-overhead": " cuda-graphs"}


def compile_modes(compile) -> tuple[str, ...]:
    """``compile`` as modes: False / None / () none, True ("default",), a mode or several."""
    if not compile:
        return ()
    modes = ("default",) if compile is True else (
        (compile,) if isinstance(compile, str) else tuple(compile))
    bad = [m for m in modes if m not in COMPILE_MODES]
    if bad:
        raise ValueError(f"compile mode(s) {', '.join(bad)} unknown; choose from "
                         f"{', '.join(COMPILE_MODES)}")
    return modes


def compile_blocks(model, mode: str) -> None:
    """Every block torch.compile'd in place in ``mode``, as the trainer's compile=true does.
    ``MOEIFY_COMPILE_BACKEND`` (e.g. "eager"): trace with that backend instead (the GPU check's
    CPU smoke run: the compiled path without inductor's compile time; the mode then only
    names the row)."""
    backend = os.environ.get("MOEIFY_COMPILE_BACKEND")
    for block in model.blocks:
        block.compile(**({"backend": backend} if backend else {"mode": mode}))


def step_phases(config_json: str, *, batch: int, device: str = "cpu", dtype: str = "float32",
                seed: int = 0, steps: int = 1, compile: bool | str = False) -> dict:
    """``steps`` training steps as phases {"step 1": ..., ...}; also the memory factory.
    ``compile``: every block torch.compile'd in place (True: mode "default", or a mode of
    ``COMPILE_MODES``), as the trainer's compile=true does."""
    cfg = ModelConfig.from_json(config_json)
    torch.manual_seed(seed)
    model = cfg.build()
    if torch.device(device) != torch.device("cpu"):  # (fake tensors cannot be moved in place)
        model = model.to(device)
    model.train()
    for mode in compile_modes(compile):
        compile_blocks(model, mode)
    params = list(model.parameters())
    opt = adamw(params, lr=LR, betas=(0.9, 0.999), weight_decay=0.0)  # the trainer's AdamW
    g = torch.Generator().manual_seed(seed + 1)
    ids_BT = torch.randint(0, cfg.vocab_size, (batch, cfg.context_length + 1),
                           generator=g).to(device)
    memory = None
    if cfg.xl_memory:
        with torch.no_grad(), autocast_for(device, dtype):
            memory = model(ids_BT[:, :-1]).memory

    def step():
        with autocast_for(device, dtype):  # as the trainer calls it: no logits returned
            out = model(ids_BT[:, :-1], ids_BT[:, 1:], memory=memory, return_logits=False)
        (out.loss + out.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {f"step {i + 1}": step for i in range(steps)}


def model_forward_macs(cfg: ModelConfig) -> tuple[int, int | None]:
    """(attention MACs, whole-model MACs or None) per sequence, forward (module docstring)."""
    attn = sum(r["macs"] for r in model_cost(cfg).layers)
    T, d = cfg.context_length, cfg.d_model
    total = attn + d * cfg.vocab_size * T
    for ff in cfg.feedforward_layers():
        if not isinstance(ff, DenseFFConfig):
            return attn, None
        total += 2 * d * ff.d_ff * T
    return attn, total


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def bench_step(presets: Sequence = DEFAULT_STEP_PRESETS, *, batch: int = 4, device: str = "cpu",
               dtype: str = "float32", memory: bool = True, warmup: int = 1, repeats: int = 5,
               seed: int = 0, compile=False, compiled_memory: bool = True) -> dict:
    """Time (and measure) a training step of every model; ratios are to the first one (the paper
    row's dense preset is put first when the first given one has no dense attention).
    ``compile``: every model also compiled, per mode (True: "default"; or modes of
    ``COMPILE_MODES``): rows "NAME compiled" (default) and "NAME cuda-graphs"
    (reduce-overhead), timed in the same interleaved repeats; "vs eager" = compiled / eager
    time of the same model. Compilation (and CUDA-graph recording) happens in the warm-up,
    which is then at least three steps. ``compiled_memory``: measure the compiled rows' memory
    too (each in a fresh process that compiles again)."""
    if batch < 1 or repeats < 1 or warmup < 0:
        raise ValueError("batch and repeats must be positive and warmup non-negative")
    autocast_for(device, dtype)  # validates dtype
    cases = _with_dense_first(resolve_cases(presets))
    base_name = cases[0][0]
    modes = compile_modes(compile)
    # (row, config, compile mode or "", the eager row of the same model)
    variants = [(f"{name}{COMPILE_MODES[m] if m else ''}", cfg, m, name) for name, cfg in cases
                for m in ("",) + modes]
    if modes:
        warmup = max(warmup, 3)
    setup = dict(batch=batch, device=device, dtype=dtype, seed=seed)
    fns = {label: step_phases(cfg.to_json(), compile=c, **setup)["step 1"]
           for label, cfg, c, _ in variants}
    times = interleaved_median_times(fns, warmup=warmup, repeats=repeats, device=device)
    del fns
    peaks = {}
    if memory:
        peaks = _step_peaks([v for v in variants if compiled_memory or not v[2]], setup)
    macs = {label: model_forward_macs(cfg) for label, cfg, _, _ in variants}
    rows = [_step_row(name, cfg, c, eager, times, peaks, macs, base_name, modes)
            for name, cfg, c, eager in variants]
    return {"bench": "step", "baseline": base_name, "batch": batch, "device": str(device),
            "dtype": dtype, "threads": torch.get_num_threads(),
            "omp_wait_policy": omp_wait_policy(), "warmup": warmup, "repeats": repeats,
            "compile": list(modes), "rows": rows}


def _with_dense_first(cases: list[tuple[str, ModelConfig]]) -> list[tuple[str, ModelConfig]]:
    """``cases`` with the first one's dense baseline (``dense_baseline_for``) put first when
    the first has no dense attention and the baseline is not among them."""
    if not isinstance(cases[0][1].attention_layers()[0], DenseAttentionConfig):
        found = dense_baseline_for(*cases[0])
        if found is not None and found[0] not in [n for n, _ in cases]:
            cases.insert(0, found)
    return cases


def _step_peaks(variants: list[tuple], setup: dict) -> dict:
    """Each variant's memory of a step in a fresh process (``setup``: step_phases' batch,
    device, dtype and seed): the second step (the third when compiled)."""
    peaks = {}
    for label, cfg, c, _ in variants:
        ph = peak_memory("moeify.bench.step:step_phases",
                         dict(config_json=cfg.to_json(), steps=3 if c else 2, compile=c,
                              **setup), device=setup["device"], baseline="before_setup")
        peaks[label] = ph["step 3" if c else "step 2"]
    return peaks


def _step_row(name: str, cfg: ModelConfig, c: str, eager: str, times: dict, peaks: dict,
              macs: dict, base_name: str, modes: tuple) -> dict:
    """The result row of one variant, its ratios to ``base_name``."""
    mem = peaks.get(name)
    base = peaks.get(base_name)
    return {
        "case": name,
        "compile": c or None,
        "vs eager": _ratio(times[name], times[eager]) if modes else None,
        "params": model_cost(cfg).params,
        "T": cfg.context_length,
        "step ms": times[name] * 1e3,
        "time x": _ratio(times[name], times[base_name]),
        "peak MiB": mem["peak"] if mem else None,
        "peak x": _ratio(mem["peak"], base["peak"]) if mem else None,
        "step MiB": mem["working"] if mem else None,
        "step mem x": _ratio(mem["working"], base["working"]) if mem else None,
        "attn MACs x": _ratio(macs[name][0], macs[base_name][0]),
        "model MACs x": _ratio(macs[name][1], macs[base_name][1]),
    }


COMPILED_SUFFIX = COMPILE_MODES["default"]
COLUMNS = ["case", "params", "step ms", "time x", "vs eager", "peak MiB", "peak x", "step MiB",
           "step mem x", "attn MACs x", "model MACs x"]


def table(result: dict) -> str:
    head = (f"training step (fwd, bwd, clip, AdamW), batch {result['batch']}, {result['dtype']} "
            f"on {result['device']} ({result['threads']} threads, OpenMP "
            f"{result['omp_wait_policy']}), median of {result['repeats']}; "
            f"x = ratio to {result['baseline']}; tensor memory: peak = everything (weights, grads, "
            "AdamW state, activations), step = on top of the state kept between steps; MACs x: "
            "cost accounting per sequence")
    columns = [c for c in COLUMNS if c != "vs eager" or result.get("compile")]
    if result.get("compile"):
        head += ("; compiled: every block torch.compile'd (compile time excluded; cuda-graphs: "
                 "mode reduce-overhead), vs eager = compiled / eager step time of the same "
                 "model")
    return head + "\n" + format_table(result["rows"], columns)
