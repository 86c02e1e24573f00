"""Benchmark of decoding through the KV cache: prefill and per-token decode throughput and the
cache's size, of full models side by side at several contexts and batch sizes.

Shape legend: B batch, C context (tokens in the cache when decoding starts).

For every batch B and context C, each preset's model (eval mode, no_grad; float32, or autocast
to bf16 / fp16 with float32 weights; on ``device``) first
prefills B random sequences of C tokens through a fresh cache, in chunks of the model's own
context length T (the attention of a chunk of T queries over everything cached so far, as the
models are trained), then decodes one token at a time for every sequence of the batch (greedy).
Prefill is timed once per model (interleaved over the models); decode per token, interleaved
over the models token by token (CUDA events on a GPU, else wall time), median over ``tokens`` steps after ``warmup`` untimed ones.
Throughput is tokens per second: B·C / prefill time and B / per-token time. "KV MiB" counts
every tensor the caches hold after the prefill (keys, values, positions and validity of every
layer). Ratios are to the group's baseline: the first dense preset of the same d_model and
depth (models of different sizes are not compared).
"""

from __future__ import annotations

import statistics
from typing import Sequence

import torch

from moeify.bench.attention import autocast_for, group_by_shape, omp_wait_policy, resolve_cases
from moeify.bench.timing import _no_gc, _timed_call, format_table
from moeify.models.config import ModelConfig

DEFAULT_GENERATE_PRESETS = ("wt103-47m-dense", "wt103-47m-switchhead", "wt103-47m-moa-h4",
                            "wt103-45m-rope-dense", "wt103-45m-rope-switchhead")
DEFAULT_CONTEXTS = (512, 1024, 2048, 4096)
DEFAULT_BATCHES = (1, 8)
_MIB = 1024 * 1024
_CACHED = ("keys", "values", "positions", "valid")


def cache_bytes(cache: list) -> int:
    """Bytes of the tokens a model's per-layer caches hold (keys, values, positions, validity;
    spare room in their buffers not counted)."""
    total = 0
    for entry in cache:
        for name in _CACHED:
            t = getattr(entry, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _groups(cases: list[tuple[str, ModelConfig]]) -> list[list[tuple[str, ModelConfig]]]:
    """Cases of equal (d_model, n_layers), each group's dense preset first."""
    return group_by_shape(cases, key=lambda cfg: (cfg.d_model, cfg.n_layers))


class _Decoder:
    """One model's prefill and decode through its own cache."""

    def __init__(self, model, ids_BC: torch.Tensor, chunk: int):
        self.model, self.ids, self.chunk = model, ids_BC, chunk
        self.cache, self.next = None, None

    def prefill(self) -> None:
        self.cache = self.model.new_cache()
        for i in range(0, self.ids.shape[1], self.chunk):
            logits = self.model(self.ids[:, i:i + self.chunk], cache=self.cache).logits
        self.next = logits[:, -1].argmax(-1, keepdim=True)

    def step(self) -> None:
        self.next = self.model(self.next, cache=self.cache).logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def _measure(models: dict, B: int, C: int, tokens: int, warmup: int, seed: int,
             device: str, dtype: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    decs = {}
    for name, model in models.items():
        ids = torch.randint(0, model.config.vocab_size, (B, C), generator=g).to(device)
        decs[name] = _Decoder(model, ids, model.config.context_length)
    out = {name: {} for name in decs}
    with _no_gc(), autocast_for(device, dtype):
        for name, d in decs.items():
            out[name]["prefill s"] = _timed_call(d.prefill, device)
            out[name]["kv bytes"] = cache_bytes(d.cache)
        steps = {name: [] for name in decs}
        for i in range(warmup + tokens):
            for name, d in decs.items():
                t = _timed_call(d.step, device)
                if i >= warmup:
                    steps[name].append(t)
    for name in decs:
        out[name]["decode s"] = statistics.median(steps[name])
    return out


def bench_generate(presets: Sequence = DEFAULT_GENERATE_PRESETS, *,
                   contexts: Sequence[int] = DEFAULT_CONTEXTS,
                   batches: Sequence[int] = DEFAULT_BATCHES, tokens: int = 8, warmup: int = 2,
                   seed: int = 0, device: str = "cpu", dtype: str = "float32") -> dict:
    """Measure every (group, batch, context) cell (module docstring)."""
    if not contexts or not batches or min(*contexts, *batches) < 1:
        raise ValueError("contexts and batches must be positive integers (at least one each)")
    if tokens < 1 or warmup < 0:
        raise ValueError("tokens must be positive and warmup non-negative")
    autocast_for(device, dtype)  # validates dtype
    cells = []
    for members in _groups(resolve_cases(presets)):
        torch.manual_seed(seed)
        models = {name: cfg.build().to(device).eval() for name, cfg in members}
        base = members[0][0]
        for B in batches:
            for C in contexts:
                m = _measure(models, B, C, tokens, warmup, seed, device, dtype)
                b = m[base]
                rows = [{
                    "case": name, "batch": B, "context": C,
                    "prefill tok/s": B * C / r["prefill s"],
                    "prefill x": b["prefill s"] / r["prefill s"],
                    "decode tok/s": B / r["decode s"],
                    "decode x": b["decode s"] / r["decode s"],
                    "decode ms": r["decode s"] * 1e3,
                    "KV MiB": r["kv bytes"] / _MIB,
                    "KV x": r["kv bytes"] / b["kv bytes"],
                } for name, r in m.items()]
                cells.append({"baseline": base, "batch": B, "context": C, "rows": rows})
        del models
    return {"bench": "generate", "device": str(device), "dtype": dtype,
            "threads": torch.get_num_threads(), "omp_wait_policy": omp_wait_policy(),
            "tokens": tokens, "warmup": warmup, "cells": cells}


COLUMNS = ["case", "batch", "context", "prefill tok/s", "prefill x", "decode ms", "decode tok/s",
           "decode x", "KV MiB", "KV x"]


def table(result: dict) -> str:
    head = (f"decoding through the KV cache, {result['dtype']} on {result['device']} "
            f"({result['threads']} threads, OpenMP "
            f"{result['omp_wait_policy']}); decode: median of {result['tokens']} tokens per "
            "sequence; x = throughput (KV: size) ratio to the group's dense baseline")
    rows = [r for c in result["cells"] for r in c["rows"]]
    return head + "\n" + format_table(rows, COLUMNS)
