"""The one model loader: a run's (or one checkpoint's) model, in eval mode, with its tokenizer,
from either kind of checkpoint (layout: moeify.rundir). Training, evaluation, generation,
export, analysis and the lm-eval model type all load runs here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeify.data.tokenizers import load_tokenizer
from moeify.errors import MoeifyError
from moeify.models.config import ModelConfig
from moeify.rundir.checkpoints import Checkpoint, is_sharded_checkpoint, load_model_checkpoint
from moeify.rundir.files import model_config_dict, read_model_config, \
    read_train_config_dict
from moeify.rundir.layout import (CONFIG_FILE, MODEL_FILE, checkpoint_dirs, resolve_checkpoint,
                                  run_dir_of)


@dataclass
class TrainedModel:
    model: torch.nn.Module
    tokenizer: Any
    model_config: ModelConfig
    train_config: dict[str, Any] | None  # config.json as written (moeify.train.config parses it)
    checkpoint: Checkpoint
    run_dir: Path


def load_trained(path: str | Path, device: str | torch.device = "cpu", *,
                 single_file_only: bool = False) -> TrainedModel:
    """The model of a run (its ``latest_checkpoint``) or of one checkpoint directory, on
    ``device``, in eval mode, its checkpoint verified (moeify.rundir.checkpoints).

    ``single_file_only``: read single-file checkpoints only (``moeify plot`` and lm-eval's own
    loading of the ``moeify`` model type, which promise that); the newest single-file checkpoint
    is taken, and a run that holds only sharded ones is refused with a message saying how to
    write one."""
    ckpt_dir = resolve_checkpoint(path)
    if single_file_only and is_sharded_checkpoint(ckpt_dir):
        ckpt_dir = _newest_single_file(path, ckpt_dir)
    run_dir = run_dir_of(ckpt_dir)
    model_cfg = read_model_config(run_dir)
    tokenizer = load_tokenizer(run_dir)
    if tokenizer.vocab_size != model_cfg.vocab_size:
        raise MoeifyError(f"{run_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                          f"model {model_cfg.vocab_size}; the run directory is inconsistent")
    model = model_cfg.build()
    ckpt = load_model_checkpoint(ckpt_dir, model, model_config=model_config_dict(model_cfg))
    model.to(device).eval()
    train_cfg = read_train_config_dict(run_dir) if (run_dir / CONFIG_FILE).is_file() else None
    return TrainedModel(model, tokenizer, model_cfg, train_cfg, ckpt, run_dir)


def _newest_single_file(path: str | Path, sharded: Path) -> Path:
    """The newest single-file checkpoint of the run ``sharded`` belongs to."""
    if Path(path).resolve() == sharded.resolve():  # one checkpoint named: no other to choose
        candidates = []
    else:
        candidates = [d for d in checkpoint_dirs(run_dir_of(sharded)) if (d / MODEL_FILE).is_file()]
    if not candidates:
        raise MoeifyError(f"{path} holds only sharded checkpoints (a parallel=fsdp run); "
                          "this command reads single-file checkpoints: resume the run for "
                          "one more step with --set parallel=ddp to write one")
    return candidates[-1]
