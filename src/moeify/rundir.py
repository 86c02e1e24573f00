"""The run-directory layout and its read-only access, shared by training (moeify.train.rundir,
which writes runs) and analysis (moeify.analysis.rundir, which never imports train).

    RUN/config.json                      the resolved TrainConfig
    RUN/model.json                       the resolved ModelConfig (vocabulary = the tokenizer's)
    RUN/tokenizer.json (+ model files)   moeify.data.tokenizers.load_tokenizer
    RUN/metrics.jsonl                    {"kind": "train" | "valid", "step", "tokens", ...}
    RUN/checkpoints/latest               name of the newest complete checkpoint
    RUN/checkpoints/step-*/model.safetensors, meta.json   (moeify.train.checkpoint)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moeify.errors import MoeifyError
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
        return json.loads(path.read_text())
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
