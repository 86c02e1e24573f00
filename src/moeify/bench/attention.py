"""Benchmark of one attention layer at a preset's shapes: the dense baseline, SwitchHead and MoA
side by side, forward and forward+backward time and peak memory, with the cost-accounting MAC
and memory ratios (moeify.models.cost) beside the measured ones.

Shape legend: B batch, T chunk length (queries), S = 2T source tokens with XL memory (else T),
D d_model.

Cases are grouped by shape (d_model, T, XL memory); within a group every case sees the same
input and the ratios are to the group's baseline, its first dense preset (a group without one
gets the paper row's dense preset, ``dense_baseline_for``). A "textbook" row times
``moeify.bench.textbook`` with the baseline's weights: the dense layer written as the papers'
reference code writes it, so the baseline is shown not to be slowed artificially.

The layer runs as inside a block: training mode, queries x [B, T, D], and with XL memory the
source [mem ; x] built inside the timed call (so gradients reach x through both sides), with a
fixed random output gradient; MoA's auxiliary losses are part of the backward. Times are medians
of interleaved repeats (``interleaved_median_times``); "fwd" runs under ``torch.no_grad``
(inference), "fwd+bwd" is a training call. Peak memory is the most tensor memory one call holds
above the weights and inputs, measured in a fresh process (``moeify.bench.memory``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Sequence

import torch

from moeify.bench.memory import peak_memory
from moeify.bench.op_times import op_times
from moeify.bench.textbook import textbook_attention
from moeify.bench.timing import format_table, interleaved_median_times
from moeify.layers.attention import DenseAttentionConfig
from moeify.models.config import ModelConfig
from moeify.models.cost import attention_cost, attention_summary
from moeify.models.presets import PRESETS, get_preset

DEFAULT_PRESETS = ("wt103-47m-dense", "wt103-47m-switchhead", "wt103-47m-moa-h4",
                   "wt103-45m-rope-dense", "wt103-45m-rope-switchhead")
DEFAULT_TOKENS = 2048  # batch = tokens // T: 8 x 256 for the 47M XL rows, 4 x 512 for RoPE 45M
TEXTBOOK_SUFFIX = " (textbook)"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def omp_wait_policy() -> str:
    """The OpenMP wait policy this process runs under ("default": libgomp's, idle threads spin a
    while before sleeping); moeify.cli.bench (``--omp-wait``) says when PASSIVE is the fairer
    choice."""
    return os.environ.get("OMP_WAIT_POLICY", "default")


def autocast_for(device: str, dtype: str):
    """float32: plain; bfloat16 / float16: autocast with float32 weights, as training runs."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=DTYPES[dtype])


def resolve_cases(presets: Sequence) -> list[tuple[str, ModelConfig]]:
    """Preset names (or ready ``(name, ModelConfig)`` pairs) -> ``(name, config)`` pairs."""
    out = []
    for p in presets:
        if isinstance(p, str):
            out.append((p, get_preset(p)))
        else:
            name, cfg = p
            if not isinstance(cfg, ModelConfig):
                raise ValueError(f"case {name!r}: expected a ModelConfig, got {type(cfg).__name__}")
            out.append((name, cfg))
    if not out:
        raise ValueError("no presets to benchmark; pass at least one --preset")
    return out


def _is_dense(cfg: ModelConfig) -> bool:
    return isinstance(cfg.attention_layers()[0], DenseAttentionConfig)


def _shape(cfg: ModelConfig) -> tuple:
    return (cfg.d_model, cfg.context_length, cfg.xl_memory)


def dense_baseline_for(name: str, cfg: ModelConfig) -> tuple[str, ModelConfig] | None:
    """The dense preset a preset is compared with (its table entry's ``baseline``), when it has
    the same shape. None if there is none."""
    entry = PRESETS.get(name)
    if entry is None or entry.baseline is None:
        return None
    dense = get_preset(entry.baseline)
    if _is_dense(dense) and _shape(dense) == _shape(cfg):
        return entry.baseline, dense
    return None


def with_expert_impls(name: str, cfg: ModelConfig, impls: Sequence[str]):
    """``(name, cfg)`` once per expert kernel in ``impls`` ("NAME [KERNEL]", every attention
    layer's ``expert_impl`` set), or as it is when its attention has no experts."""
    if not all(hasattr(a, "expert_impl") for a in cfg.attention):
        return [(name, cfg)]
    return [(f"{name} [{impl}]", dataclasses.replace(cfg, attention=tuple(
        dataclasses.replace(a, expert_impl=impl) for a in cfg.attention))) for impl in impls]


def add_dense_baselines(cases: list[tuple[str, ModelConfig]]) -> list[tuple[str, ModelConfig]]:
    """Prepend the matching dense preset (``dense_baseline_for``) of every shape that has no
    dense case, so that `--preset wt103-47m-switchhead` alone is compared with its baseline."""
    have = {_shape(c) for _, c in cases if _is_dense(c)}
    extra = []
    for name, cfg in cases:
        if _shape(cfg) in have:
            continue
        found = dense_baseline_for(name, cfg)
        if found is not None:
            extra.append(found)
            have.add(_shape(cfg))
    return extra + list(cases)


def group_by_shape(cases: list[tuple[str, ModelConfig]], key=None,
                   ) -> list[list[tuple[str, ModelConfig]]]:
    """Groups of cases with equal ``key(config)`` (default (d_model, T, XL memory)), in order of
    first appearance; each group's first dense-attention case moves to the front (the
    baseline)."""
    key = key or _shape
    groups: dict[tuple, list] = {}
    for name, cfg in cases:
        groups.setdefault(key(cfg), []).append((name, cfg))
    out = []
    for members in groups.values():
        dense = [i for i, (_, c) in enumerate(members) if _is_dense(c)]
        if dense:
            members.insert(0, members.pop(dense[0]))
        out.append(members)
    return out


def layer_phases(config_json: str, *, batch: int, textbook: bool = False, device: str = "cpu",
                 dtype: str = "float32", seed: int = 0, compile: bool = False) -> dict:
    """The timed calls of one case: {"fwd": ..., "fwd+bwd": ...}. Also the memory factory
    (``moeify.bench.memory``), hence JSON-able arguments. ``compile``: the layer is
    torch.compile'd in place."""
    cfg = ModelConfig.from_json(config_json)
    attn_cfg = cfg.attention_layers()[0]
    if textbook and not isinstance(attn_cfg, DenseAttentionConfig):
        raise ValueError("the textbook implementation exists for dense attention only")
    torch.manual_seed(seed)
    layer = attn_cfg.build().to(device)
    layer.train()
    if compile:
        layer.compile()
    B, T, D = batch, cfg.context_length, cfg.d_model
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(B, T, D, generator=g).to(device).requires_grad_()
    mem = torch.randn(B, T, D, generator=g).to(device) if cfg.xl_memory else None
    grad_y = torch.randn(B, T, D, generator=g).to(device)
    params = list(layer.parameters())

    def call():
        kv = None if mem is None else torch.cat([mem, x], 1)
        with autocast_for(device, dtype):
            if textbook:
                return textbook_attention(layer, x, kv), []
            y, aux = layer(x, kv)
            return y, list(aux.losses.values())

    def fwd():
        with torch.no_grad():
            call()

    def fwd_bwd():
        y, losses = call()
        torch.autograd.backward([y, *losses], [grad_y.to(y.dtype)]
                                + [torch.ones_like(v) for v in losses])
        x.grad = None
        for p in params:
            p.grad = None

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def bench_attention(presets: Sequence = DEFAULT_PRESETS, *, batch: int | None = None,
                    tokens: int = DEFAULT_TOKENS, device: str = "cpu", dtype: str = "float32",
                    textbook: bool = True, memory: bool = True, warmup: int = 2,
                    repeats: int = 5, seed: int = 0, compile: bool = False, ops: int = 0,
                    expert_impls: Sequence[str] = ()) -> dict:
    """Time (and measure) every case; one result group per shape (see the module docstring).
    ``ops`` > 0: also split each eager case's forward+backward by operation
    (``moeify.bench.op_times``, after the timing, ``repeats`` calls): its GEMMs, the rest, and
    its ``ops`` slowest operations; "GEMM x" is the case's GEMM time over the baseline's
    operation time (what the layer would take against the baseline if nothing but its GEMMs
    cost anything).
    ``batch`` fixes the batch of every group, else it is ``tokens // T`` (at least 1).
    ``compile``: every layer is also timed torch.compile'd, as the row "NAME compiled" in the
    same interleaved repeats ("vs eager": compiled / eager time of the same layer); compilation
    happens in the warm-up (at least two calls of each phase).
    ``expert_impls``: each case with expert attention runs once per kernel named, forced
    (``expert_impl``; "auto" the policy's choice), as rows "NAME [KERNEL]"."""
    if batch is not None and batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch}")
    if tokens < 1 or repeats < 1 or warmup < 0 or ops < 0:
        raise ValueError("tokens and repeats must be positive, warmup and ops non-negative")
    autocast_for(device, dtype)  # validates dtype
    cases_in = add_dense_baselines(resolve_cases(presets))
    if expert_impls:
        cases_in = [v for case in cases_in for v in with_expert_impls(*case, expert_impls)]
    groups = []
    for members in group_by_shape(cases_in):
        B = batch or max(1, tokens // members[0][1].context_length)
        setup = dict(batch=B, device=device, dtype=dtype, seed=seed)
        groups.append(_bench_group(members, setup, textbook=textbook, memory=memory,
                                   warmup=warmup, repeats=repeats, compile=compile, ops=ops))
    return {"bench": "attention", "device": str(device), "dtype": dtype, "compile": compile,
            "ops": ops,
            "threads": torch.get_num_threads(), "omp_wait_policy": omp_wait_policy(),
            "warmup": warmup, "repeats": repeats, "groups": groups}


def _group_cases(members: list[tuple[str, ModelConfig]], *, compile: bool,
                 textbook: bool) -> list[tuple]:
    """The rows of a shape group: (label, preset name, config, textbook, compiled)."""
    base_name = members[0][0]
    cases = []
    for name, cfg in members:
        cases.append((name, name, cfg, False, False))
        if compile:
            cases.append((name + COMPILED_SUFFIX, name, cfg, False, True))
        if (textbook and name == base_name
                and isinstance(cfg.attention_layers()[0], DenseAttentionConfig)):
            cases.append((name + TEXTBOOK_SUFFIX, name, cfg, True, False))
    return cases


def _bench_group(members: list[tuple[str, ModelConfig]], setup: dict, *, textbook: bool,
                 memory: bool, warmup: int, repeats: int, compile: bool, ops: int) -> dict:
    """One shape group, timed side by side (``setup``: layer_phases' batch, device, dtype and
    seed)."""
    base_name, base_cfg = members[0]
    T, xl = base_cfg.context_length, base_cfg.xl_memory
    C = 2 if xl else 1
    cases = _group_cases(members, compile=compile, textbook=textbook)
    fns = {}
    for label, _, cfg, tb, c in cases:
        ph = layer_phases(cfg.to_json(), textbook=tb, compile=c, **setup)
        fns[(label, "fwd")], fns[(label, "fwd+bwd")] = ph["fwd"], ph["fwd+bwd"]
    times = interleaved_median_times(fns, warmup=max(warmup, 2) if compile else warmup,
                                     repeats=repeats, device=setup["device"])
    del fns
    split = {}
    if ops:
        for label, _, cfg, tb, c in cases:
            if not c:  # the timer sees the eager operations, not a compiled graph
                split[label] = op_times(layer_phases(cfg.to_json(), textbook=tb, **setup
                                                     )["fwd+bwd"], repeats=repeats, top=ops)
    peaks = {}
    if memory:
        for label, _, cfg, tb, c in cases:
            peaks[label] = peak_memory(
                "moeify.bench.attention:layer_phases",
                dict(config_json=cfg.to_json(), textbook=tb, compile=c, **setup),
                device=setup["device"])
    base_cost = attention_cost(base_cfg.attention_layers()[0], T=T, C=C)
    rows = []
    for case in cases:
        label = case[0]
        rows.append(_row(case, times, peaks, base_name, base_cost, T=T, C=C, compile=compile))
        if label in split:
            rows[-1]["ops"] = split[label]
            rows[-1]["GEMM x"] = split[label]["gemm ms"] / split[base_name]["ops ms"]
    return {"baseline": base_name, "batch": setup["batch"], "T": T, "S": C * T, "xl_memory": xl,
            "d_model": base_cfg.d_model, "rows": rows}


def _row(case: tuple, times: dict, peaks: dict, base_name: str, base_cost, *, T: int, C: int,
         compile: bool) -> dict:
    """The result row of one case, its ratios to the group's baseline ``base_name``."""
    label, name, cfg, tb, _ = case
    attn = cfg.attention_layers()[0]
    cost = attention_cost(attn, T=T, C=C)
    mem = peaks.get(label, {})
    peak = mem["fwd+bwd"]["working"] if mem else None
    return {
        "case": label,
        "attention": attention_summary(attn) + (" textbook" if tb else ""),
        "fwd ms": times[(label, "fwd")] * 1e3,
        "fwd+bwd ms": times[(label, "fwd+bwd")] * 1e3,
        "fwd x": _ratio(times[(label, "fwd")], times[(base_name, "fwd")]),
        "fwd+bwd x": _ratio(times[(label, "fwd+bwd")], times[(base_name, "fwd+bwd")]),
        "vs eager": (_ratio(times[(label, "fwd+bwd")], times[(name, "fwd+bwd")])
                     if compile and not tb else None),
        "MACs": cost.macs,
        "MACs x": cost.macs / base_cost.macs,
        "fwd peak MiB": mem["fwd"]["working"] if mem else None,
        "peak MiB": peak,
        "peak x": _ratio(peak, peaks[base_name]["fwd+bwd"]["working"] if mem else None),
        "Mem x": cost.memory / base_cost.memory,
    }


COMPILED_SUFFIX = " compiled"
COLUMNS = ["case", "fwd ms", "fwd x", "fwd+bwd ms", "fwd+bwd x", "vs eager", "MACs x", "peak MiB",
           "peak x", "Mem x"]


def table(result: dict) -> str:
    parts = []
    for g in result["groups"]:
        mem = f"XL memory {g['S'] - g['T']}" if g["xl_memory"] else "no memory"
        head = (f"one attention layer, d={g['d_model']} T={g['T']} {mem}, batch {g['batch']}, "
                f"{result['dtype']} on {result['device']} ({result['threads']} threads, OpenMP "
                f"{result['omp_wait_policy']}), median "
                f"of {result['repeats']}; x = ratio to {g['baseline']}; MACs x / Mem x: cost "
                "accounting (moeify.models.cost); peak: tensor memory of fwd+bwd above weights "
                "and inputs")
        columns = COLUMNS
        if result.get("compile"):
            head += ("; compiled: torch.compile'd layer (compile time excluded), vs eager = "
                     "compiled / eager fwd+bwd time of the same layer")
        else:
            columns = [c for c in COLUMNS if c != "vs eager"]
        parts.append(head + "\n" + format_table(g["rows"], columns))
        if any("ops" in r for r in g["rows"]):
            parts.append(_ops_table(g, result["repeats"]))
    return "\n\n".join(parts)


def _count(calls: float) -> int | str:
    """Calls per forward+backward: a whole number prints as one (not 4.000)."""
    return int(calls) if float(calls).is_integer() else f"{calls:g}"


def _ops_table(group: dict, repeats: int) -> str:
    rows = [r for r in group["rows"] if "ops" in r]
    split = [{"case": r["case"], "ops ms": r["ops"]["ops ms"], "GEMM ms": r["ops"]["gemm ms"],
              "other ms": r["ops"]["other ms"], "GEMM x": r["GEMM x"]} for r in rows]
    out = [f"fwd+bwd by operation (each ATen operation timed as dispatched, mean of {repeats} "
           "calls; ops = their sum, without the Python between them; GEMM x = GEMM ms / the "
           "baseline's ops ms)",
           format_table(split, ["case", "ops ms", "GEMM ms", "other ms", "GEMM x"])]
    for r in rows:
        top = [{"op": t["op"], "shapes": " ".join("x".join(map(str, s)) or "scalar"
                                                  for s in t["shapes"]),
                "ms": t["ms"], "calls": _count(t["calls"])} for t in r["ops"]["top"]]
        out.append(f"slowest operations of {r['case']}:\n"
                   + format_table(top, ["op", "shapes", "ms", "calls"]))
    return "\n\n".join(out)
