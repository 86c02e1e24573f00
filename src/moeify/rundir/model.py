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
from moeify.rundir.checkpoints import Checkpoint, load_model_checkpoint
from moeify.rundir.files import model_config_dict, read_model_config, \
    read_train_config_dict
from moeify.rundir.layout import CONFIG_FILE, resolve_checkpoint, run_dir_of


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
    ``device``, in eval mode, its checkpoint verified (moeify.rundir.checkpoints). Either kind
    of checkpoint loads in this one process: a sharded one (FSDP, expert parallelism) is read
    shard by shard into the plain model. ``single_file_only`` is accepted and changes nothing
    (every reader reads both kinds)."""
    ckpt_dir = resolve_checkpoint(path)
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
