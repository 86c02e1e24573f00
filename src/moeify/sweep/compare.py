"""``moeify compare``: train several presets on the same data for the same steps (same seed,
same token order), each in its own child process (moeify.sweep.scheduler), then write
OUT/results.json, OUT/results.md and OUT/curves.png (the comparison itself is
moeify.analysis.compare). Runs live in OUT/runs/PRESET."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from moeify.analysis.compare import run_record, write_results
from moeify.data import load_corpus
from moeify.sweep.protocol import Scoring, run_spec
from moeify.sweep.scheduler import (lock_out, plan_run, refuse_other_study, report_written,
                                    run_settings, train_all)
from moeify.train.config import TrainConfig, resolve_model_config


def train_configs(presets: list[str], data: str, steps: int, seed: int,
                  overrides: list[str]) -> dict:
    """preset -> (TrainConfig, resolved ModelConfig); a ValueError when the presets' context
    lengths differ (their token order would)."""
    cfgs = {}
    for p in presets:
        cfg = TrainConfig(preset=p, data=data, steps=steps, seed=seed).with_overrides(overrides)
        cfgs[p] = (cfg, resolve_model_config(cfg))
    lengths = {m.context_length for _, m in cfgs.values()}
    if len(lengths) != 1:
        raise ValueError("the presets have different context lengths "
                         f"({', '.join(f'{p}: {m.context_length}' for p, (_, m) in cfgs.items())})"
                         ", so their token order would differ; set model.context_length=N")
    return cfgs


def compare(presets: list[str], out: Path, *, data: str, steps: int, seed: int,
            overrides: list[str], jobs: int, threads: int | None, scoring: Scoring,
            last_k: int, reuse: bool) -> int:
    """Train (or reuse, or resume) every preset's run under ``out`` and write the results;
    holds the lock on ``out`` throughout. Returns the exit status (1 when nothing finished);
    a failure or interruption is raised after what finished has been written."""
    cfgs = train_configs(presets, data, steps, seed, overrides)
    refuse_other_study(out, "compare")
    lock = lock_out(out, "compare")
    try:
        return _compare(presets, cfgs, out, data=data, steps=steps, seed=seed,
                        overrides=overrides, jobs=jobs, threads=threads, scoring=scoring,
                        last_k=last_k, reuse=reuse)
    finally:
        lock.release()


def _compare(presets: list[str], cfgs: dict, out: Path, *, data: str, steps: int, seed: int,
             overrides: list[str], jobs: int, threads: int | None, scoring: Scoring,
             last_k: int, reuse: bool) -> int:
    threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    specs, results = [], {}
    for p in presets:
        run_dir = out / "runs" / p
        spec = run_spec(p, cfgs[p][0], run_dir, threads, scoring)
        reused = plan_run(run_dir, spec, reuse=reuse)
        if reused is not None:
            results[p] = reused
            print(f"[compare] reusing the finished run {run_dir}", file=sys.stderr)
            continue
        specs.append(spec)
    load_corpus(data)  # prepare the corpus once, before the runs share it
    t0 = time.time()
    done, error = train_all(specs, jobs, "compare")
    results.update(done)
    finished = [p for p in presets if p in results]
    rows = []
    for p in finished:
        r = results[p]
        cuda = r.get("cuda_peak_bytes")
        rows.append(run_record(
            p, out / "runs" / p, final_valid=r["final_valid"],
            peak_memory_bytes=cuda if cuda else r.get("max_rss_bytes"),
            peak_memory_kind="CUDA max allocated" if cuda else "max resident set size (RSS)",
            blimp=r.get("blimp"), listops=r.get("listops")))
    cfg0 = cfgs[presets[0]][0]
    settings = {"presets": ",".join(presets), "data": data, "steps": steps,
                "seed": seed, "batch_size": cfg0.batch_size,
                "context_length": cfgs[presets[0]][1].context_length, "lr": cfg0.lr,
                "warmup_steps": cfg0.warmup_steps, "grad_clip": cfg0.grad_clip,
                "overrides": " ".join(overrides) or "none", "jobs": jobs,
                "threads_per_run": threads, **run_settings([results[p] for p in finished]),
                "this_invocation_wall_s": round(time.time() - t0, 1)}
    if error is not None:
        settings["unfinished"] = ",".join(p for p in presets if p not in results)
    if rows:
        written = write_results(out, rows, settings, last_k=last_k)
        print((out / "results.md").read_text())
        report_written(out, written)
    if error is not None:
        raise error
    return 0 if rows else 1
