"""Read-only access to run directories for analysis (never imports moeify.train); the layout is
moeify.rundir's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeify.data.cache import read_jsonl
from moeify.errors import MoeifyError
from moeify import rundir
from moeify.models.config import ModelConfig


def check_run_dir(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MoeifyError(f"run directory {run_dir} does not exist")
    return run_dir


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


def latest_checkpoint(run_dir: str | Path) -> Path:
    root = check_run_dir(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        ckpt = root / pointer.read_text().strip()
        if (ckpt / "model.safetensors").is_file():
            return ckpt
    steps = sorted(p for p in root.glob("step-*") if (p / "model.safetensors").is_file()) \
        if root.is_dir() else []
    if not steps:
        raise MoeifyError(f"{run_dir} has no checkpoint yet (checkpoints/step-*/"
                          "model.safetensors); train it first")
    return steps[-1]


@dataclass
class RunModel:
    model: torch.nn.Module
    tokenizer: Any
    config: ModelConfig
    checkpoint: Path


def load_run_model(run_dir: str | Path, device: str | torch.device = "cpu") -> RunModel:
    """The run's model from its latest checkpoint, in eval mode, with its tokenizer."""
    from safetensors.torch import load_file

    from moeify.data.tokenizers import load_tokenizer

    config = read_model_config(run_dir)
    tokenizer = load_tokenizer(run_dir)
    ckpt = latest_checkpoint(run_dir)
    try:
        state = load_file(str(ckpt / "model.safetensors"))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise MoeifyError(f"{ckpt / 'model.safetensors'} is corrupt ({e})") from None
    model = config.build()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise MoeifyError(f"{ckpt} does not fit the run's model.json (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    return RunModel(model.to(device).eval(), tokenizer, config, ckpt)
