"""The run-directory layout and its read-only access, shared by training (moeify.train.rundir,
which writes runs), analysis (moeify.analysis.rundir) and interop (moeify.interop), which never
import train; ``load_run_model`` loads a run's latest checkpoint with its tokenizer.

    RUN/config.json                      the resolved TrainConfig
    RUN/model.json                       the resolved ModelConfig (vocabulary = the tokenizer's)
    RUN/tokenizer.json (+ model files)   moeify.data.tokenizers.load_tokenizer
    RUN/metrics.jsonl                    {"kind": "train" | "valid", "step", "tokens", ...}
    RUN/checkpoints/latest               name of the newest complete checkpoint
    RUN/checkpoints/step-*/model.safetensors, meta.json   (moeify.train.checkpoint)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeify.errors import MoeifyError, read_utf8
from moeify.models.config import ModelConfig

CONFIG_FILE = "config.json"
MODEL_CONFIG_FILE = "model.json"
METRICS_FILE = "metrics.jsonl"


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
    """config.json as a plain dict ({} when the run has none)."""
    path = Path(run_dir) / CONFIG_FILE
    return read_json(path, "training configuration") if path.is_file() else {}


def check_run_dir(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MoeifyError(f"run directory {run_dir} does not exist")
    return run_dir


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
        if root.is_dir() and any(root.glob("step-*/dcp")):
            raise MoeifyError(f"{run_dir} holds only sharded checkpoints (a parallel=fsdp run); "
                              "this command reads single-file checkpoints: resume the run for "
                              "one more step with --set parallel=ddp to write one")
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

    config = read_model_config(check_run_dir(run_dir))
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
