"""Read-only access to run directories for analysis (never imports moeify.train); the layout is
moeify.rundir's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeify.data.cache import read_jsonl
from moeify.errors import MoeifyError
from moeify import rundir
from moeify.models.config import ModelConfig
# The model loader lives in moeify.rundir (interop loads runs too); re-exported here.
from moeify.rundir import RunModel, check_run_dir, latest_checkpoint, load_run_model  # noqa: F401


def read_model_config(run_dir: str | Path) -> ModelConfig:
    return rundir.read_model_config(check_run_dir(run_dir))


def read_train_config(run_dir: str | Path) -> dict[str, Any]:
    """config.json as a dict ({} when absent)."""
    return rundir.read_train_config_dict(check_run_dir(run_dir))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl (a torn last line from a crash is skipped)."""
    path = check_run_dir(run_dir) / rundir.METRICS_FILE
    if not path.is_file():
        raise MoeifyError(f"{path} is missing: the run has not logged any metrics yet")
    return read_jsonl(path)
