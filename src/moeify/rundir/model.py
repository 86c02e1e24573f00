"""The one model loader: a run's (or one checkpoint's) model, in eval mode, with its tokenizer,
from either kind of checkpoint (layout: moeify.rundir). Training, evaluation, generation,
export, analysis and the lm-eval model type all load runs here."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeify.data.tokenizers import load_tokenizer
from moeify.errors import MoeifyError
from moeify.models.config import ModelConfig
from moeify.rundir.checkpoints import (Checkpoint, is_sharded_checkpoint, load_model_checkpoint,
                                      load_model_state, load_weights)
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


def load_trained(path: str | Path, device: str | torch.device = "cpu") -> TrainedModel:
    """The model of a run (its ``latest_checkpoint``) or of one checkpoint directory, on
    ``device``, in eval mode, its checkpoint verified (moeify.rundir.checkpoints). Inference
    reads the weights only: a single-file checkpoint's optimizer state is never loaded, its
    weights are memory-mapped and keep their dtype (a bfloat16 checkpoint gives a bfloat16
    model; ``checkpoint.train_state`` is empty). A sharded checkpoint (FSDP, expert
    parallelism) is read shard by shard into the plain model, in this one process."""
    ckpt_dir = resolve_checkpoint(path)
    run_dir = run_dir_of(ckpt_dir)
    model_cfg = read_model_config(run_dir)
    tokenizer = load_tokenizer(run_dir)
    if tokenizer.vocab_size != model_cfg.vocab_size:
        raise MoeifyError(f"{run_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                          f"model {model_cfg.vocab_size}; the run directory is inconsistent")
    config = model_config_dict(model_cfg)
    if is_sharded_checkpoint(ckpt_dir):
        model = model_cfg.build()
        ckpt = load_model_checkpoint(ckpt_dir, model, model_config=config)
    else:  # weights only, memory-mapped, in their stored dtype: no optimizer, no second copy
        ckpt = load_weights(ckpt_dir, model_config=config)
        model = build_without_weights(model_cfg)
        load_model_state(model, ckpt, assign=True)
    model.to(device).eval()
    train_cfg = read_train_config_dict(run_dir) if (run_dir / CONFIG_FILE).is_file() else None
    return TrainedModel(model, tokenizer, model_cfg, train_cfg, ckpt, run_dir)


def weights_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype of a checkpoint's weights (float32 when they mix several)."""
    kinds = {t.dtype for t in state.values() if t.is_floating_point()}
    return kinds.pop() if len(kinds) == 1 else torch.float32


@contextmanager
def _parameters_on_meta():
    """Every parameter a module registers is moved to the meta device (no memory, no values);
    buffers stay real, so non-persistent ones (routing statistics, index tables) keep the
    values their layer gives them."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"),
                                                          requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def build_without_weights(model_cfg: ModelConfig) -> torch.nn.Module:
    """The model of ``model_cfg`` with its parameters on the meta device, for a checkpoint's
    weights to be assigned to (``load_state_dict(assign=True)``): no memory and no time go to
    initial values that would be overwritten. A layer whose construction needs real parameter
    values is built normally (the same model, with its initial values in memory a moment)."""
    try:
        with _parameters_on_meta():
            return model_cfg.build()
    except (RuntimeError, NotImplementedError):  # e.g. an init that reads a value (.item())
        return model_cfg.build()

