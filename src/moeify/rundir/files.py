"""The JSON files of a run directory (layout: moeify.rundir): reading them with one-line errors
that name the file, and writing them when a run is created."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moeify.data.cache import read_jsonl
from moeify.errors import MoeifyError, read_utf8
from moeify.models.config import ModelConfig
from moeify.rundir.atomic import write_json_atomic
from moeify.rundir.layout import CONFIG_FILE, METRICS_FILE, MODEL_CONFIG_FILE


def check_run_dir(run_dir: str | Path) -> Path:
    """``run_dir`` as a Path, or a MoeifyError when it does not exist."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MoeifyError(f"run directory {run_dir} does not exist")
    return run_dir


def read_json(path: Path, what: str) -> Any:
    """A run file's JSON, or a one-line MoeifyError saying which file is missing or corrupt."""
    if not path.is_file():
        raise MoeifyError(f"{path.parent} is not a moeify run directory: {path.name} ({what}) "
                          "is missing; give the directory a `moeify train --out DIR` wrote")
    try:
        return json.loads(read_utf8(path))
    except (OSError, ValueError) as e:
        raise MoeifyError(f"{path} is corrupt ({e}); it holds the run's {what}") from None


def read_model_config(run_dir: str | Path) -> ModelConfig:
    path = Path(run_dir) / MODEL_CONFIG_FILE
    try:
        return ModelConfig.from_dict(read_json(path, "model configuration"))
    except (TypeError, ValueError) as e:
        raise MoeifyError(f"{path} is not a valid model configuration ({e})") from None


def read_train_config_dict(run_dir: str | Path) -> dict[str, Any]:
    """config.json as a plain dict ({} when the run has none); moeify.train.config's
    ``read_train_config`` gives it as a validated TrainConfig."""
    path = Path(run_dir) / CONFIG_FILE
    return read_json(path, "training configuration") if path.is_file() else {}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl (a torn last line from a crash is skipped); a MoeifyError
    when the run has logged nothing yet."""
    path = check_run_dir(run_dir) / METRICS_FILE
    if not path.is_file():
        raise MoeifyError(f"{path} is missing: the run has not logged any metrics yet")
    return read_jsonl(path)


def model_config_dict(model_cfg: ModelConfig) -> dict[str, Any]:
    """The ModelConfig as it reads back from JSON (tuples as lists), for comparisons."""
    return json.loads(model_cfg.to_json())


def same_model_config(saved: Any, model_config: dict[str, Any]) -> bool:
    """Whether ``saved`` (a ModelConfig dict as a checkpoint recorded it) is the model of
    ``model_config`` (``model_config_dict``): compared as both read back, so a field left out of
    the record takes its default."""
    if saved == model_config:
        return True
    try:
        return model_config_dict(ModelConfig.from_dict(saved)) == model_config
    except (ValueError, TypeError, KeyError):
        return False


def write_run_files(run_dir: Path, cfg, model_cfg: ModelConfig, tokenizer) -> None:
    """Create ``run_dir`` with its config.json (``cfg``: a moeify.train.config.TrainConfig,
    written as its ``to_dict()``), model.json and tokenizer files."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / CONFIG_FILE, cfg.to_dict())
    write_json_atomic(run_dir / MODEL_CONFIG_FILE, model_config_dict(model_cfg))
    tokenizer.save(run_dir)
