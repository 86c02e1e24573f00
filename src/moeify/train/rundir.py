"""Run directories (layout: moeify.rundir): writing a run's files, and loading a trained model
back with its checkpoint verified."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeify.errors import MoeifyError
from moeify.models.config import ModelConfig
from moeify.rundir import CONFIG_FILE, MODEL_CONFIG_FILE, read_json, read_model_config  # noqa: F401
from moeify.train.checkpoint import (Checkpoint, checkpoint_dirs, resolve_checkpoint,
                                     run_dir_of, write_json_atomic)
from moeify.train.config import TrainConfig



def model_config_dict(model_cfg: ModelConfig) -> dict[str, Any]:
    """The ModelConfig as it reads back from JSON (tuples as lists), for comparisons."""
    return json.loads(model_cfg.to_json())


def write_run_files(run_dir: Path, cfg: TrainConfig, model_cfg: ModelConfig, tokenizer) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / CONFIG_FILE, cfg.to_dict())
    write_json_atomic(run_dir / MODEL_CONFIG_FILE, model_config_dict(model_cfg))
    tokenizer.save(run_dir)


def read_train_config(run_dir: Path) -> TrainConfig:
    data = read_json(Path(run_dir) / CONFIG_FILE, "training configuration")
    try:
        return TrainConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        raise MoeifyError(f"{Path(run_dir) / CONFIG_FILE} is not a valid training configuration "
                          f"({e})") from None


def is_run_dir(path: Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file() or bool(checkpoint_dirs(path))


def default_run_dir(root: Path, preset: str, data: str) -> Path:
    """``root/<preset>-<corpus>``, with -2, -3, ... appended when that run already exists."""
    corpus = Path(data).name if ("/" in data or "\\" in data) else data
    base = root / f"{preset}-{corpus}"
    candidate, n = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


@dataclass
class TrainedModel:
    model: torch.nn.Module
    tokenizer: Any
    model_config: ModelConfig
    train_config: TrainConfig | None
    checkpoint: Checkpoint
    run_dir: Path


def load_trained(path: str | Path, device: str | torch.device = "cpu") -> TrainedModel:
    """The model of a run (its latest checkpoint) or of one checkpoint, in eval mode."""
    from moeify.data.tokenizers import load_tokenizer

    ckpt_dir = resolve_checkpoint(path)
    run_dir = run_dir_of(ckpt_dir)
    model_cfg = read_model_config(run_dir)
    tokenizer = load_tokenizer(run_dir)
    if tokenizer.vocab_size != model_cfg.vocab_size:
        raise MoeifyError(f"{run_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                          f"model {model_cfg.vocab_size}; the run directory is inconsistent")
    from moeify.train.sharded import load_model_checkpoint

    model = model_cfg.build()
    # Either kind of checkpoint: single-file, or sharded by a multi-process (FSDP) run.
    ckpt = load_model_checkpoint(ckpt_dir, model, model_config=model_config_dict(model_cfg))
    model.to(device).eval()
    train_cfg = read_train_config(run_dir) if (run_dir / CONFIG_FILE).is_file() else None
    return TrainedModel(model, tokenizer, model_cfg, train_cfg, ckpt, run_dir)
