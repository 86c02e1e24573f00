"""What a training run reports as it goes: the clock behind tokens/s (training time only), the
metrics record of a logged step, the score of a loss (bits per character or perplexity)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeify.train.metrics import summarise_tensor


@dataclass
class Clock:
    """Training time and throughput, excluding validation and checkpoint writes."""
    tokens: int                      # tokens seen at the last mark
    start: float = field(default_factory=time.perf_counter)
    mark: float = field(default_factory=time.perf_counter)
    train_s: float = 0.0
    window: list[float] = field(default_factory=list)   # losses since the last metric record
    skipped_tokens: int = 0          # trained while compiling: not in train_s, not in the rate

    def pause(self) -> None:
        self.train_s += time.perf_counter() - self.mark

    def resume(self, tokens: int) -> None:
        self.mark, self.tokens = time.perf_counter(), tokens



def score(byte_level: bool, loss: float) -> tuple[str, float]:
    """("bpc", bits per character) for a byte-level tokenizer, else ("ppl", perplexity)."""
    if byte_level:
        return "bpc", loss / math.log(2)
    return "ppl", math.exp(min(loss, 50.0))


def train_record(step: int, tokens: int, rec: dict[str, Any], mean_loss: float, tps: float,
                 byte_level: bool) -> dict[str, Any]:
    """The metrics.jsonl record of a logged step (``rec``: what Trainer.train_step returned)."""
    name, value = score(byte_level, mean_loss)
    record = {"kind": "train", "step": step, "tokens": tokens, "loss": mean_loss, name: value,
              "lr": rec["lr"], "tokens_per_s": tps, "grad_norm": float(rec["grad_norm"]),
              "aux_loss": rec["aux_loss"]}
    record.update({f"aux/{k}": float(v.detach()) for k, v in rec["losses"].items()})
    record.update({f"stats/{k}": summarise_tensor(v) for k, v in rec["stats"].items()})
    for k, c in rec.get("load", {}).items():
        # Per-expert load of the update, all micro-batches and processes: the counts and
        # max / mean (1 = perfectly balanced).
        record[f"load/{k}"] = summarise_tensor(c)  # the counts (up to 64 experts)
        record[f"load_spread/{k}"] = float(c.max() / c.mean().clamp_min(1e-9))
    return record


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    losses: dict[int, float] = field(default_factory=dict)   # step -> LM loss (all processes)
    valid: dict[str, float] | None = None                      # the last validation
    checkpoint: Path | None = None
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    rank: int = 0                                              # this process (data parallel)
    interrupted: str | None = None                             # "SIGINT"/"SIGTERM": stopped early
    exit_code: int = 0                                         # 128 + signal number when stopped
