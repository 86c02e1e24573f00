"""Metric sinks: one JSON object per line in ``metrics.jsonl`` and, optionally, TensorBoard.

Records carry ``kind`` ("train" or "valid"), ``step`` and numbers: loss, bpc (byte-level) or ppl,
lr, tokens_per_s, grad_norm, aux losses (``aux/<layer>.<name>``) and routing statistics
(``stats/<layer>.<name>``, a number or a short list such as tokens per expert). moeify.analysis
reads the JSONL file; TensorBoard gets every number, and each entry of short lists.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from moeify.data.cache import read_jsonl
from moeify.errors import MoeifyError, install_hint
from moeify.rundir.atomic import write_bytes_atomic
from moeify.rundir.layout import METRICS_FILE

# Statistics with more entries than this are summarised (mean/min/max) instead of listed.
MAX_LISTED = 64


def summarise_tensor(t: torch.Tensor) -> Any:
    """A JSON-able view of a detached statistic: a number, a short list, or mean/min/max."""
    t = t.detach().float().cpu()
    if t.numel() == 1:
        return _num(t.item())
    if t.numel() <= MAX_LISTED:
        return [_num(v) for v in t.flatten().tolist()]
    return {"mean": _num(t.mean().item()), "min": _num(t.min().item()),
            "max": _num(t.max().item())}


def _num(v: float) -> float | None:
    if not math.isfinite(v):
        return None
    return float(f"{v:.6g}")


class MetricsSink:
    """Append records to ``run_dir/metrics.jsonl`` (and TensorBoard when asked)."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = False) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            self._tb = _summary_writer(Path(run_dir) / "tensorboard")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=False, default=_default) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record.get("step", 0))
            prefix = record.get("kind", "train")
            for key, value in record.items():
                if key in ("kind", "step"):
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{prefix}/{key}", value, step)
                elif isinstance(value, list) and len(value) <= 16:
                    for i, v in enumerate(value):
                        if isinstance(v, (int, float)):
                            self._tb.add_scalar(f"{prefix}/{key}/{i}", v, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> "MetricsSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return summarise_tensor(obj)
    raise TypeError(f"cannot write {type(obj).__name__} to metrics.jsonl")


def _summary_writer(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise MoeifyError("TensorBoard logging needs the tensorboard package: "
                          f"{install_hint('tensorboard')} (or drop --set tensorboard=true)"
                          ) from None
    return SummaryWriter(log_dir=str(log_dir))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl (a torn last line from a crash is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return read_jsonl(path)


def truncate_metrics(run_dir: str | Path, after_step: int) -> None:
    """Drop records past ``after_step`` (written after the checkpoint a run resumes from), so
    the file describes one continuous run."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return
    keep = [r for r in read_metrics(run_dir) if int(r.get("step", 0)) <= after_step]
    write_bytes_atomic(path, "".join(json.dumps(r) + "\n" for r in keep).encode())
