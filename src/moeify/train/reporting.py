"""What a training run reports as it goes: the clock behind tokens/s (training time only), the
metrics record of a logged step, the score of a loss (bits per character or perplexity), and
the writing of a logged step's and a validation's records and progress lines."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeify.train.metrics import summarise_tensor

if TYPE_CHECKING:
    from moeify.train.metrics import MetricsSink
    from moeify.train.progress import Progress


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


def log_train(tr, rec: dict[str, Any], sink: MetricsSink | None, progress: Progress,
              clock: Clock, force: bool) -> None:
    """The metrics record of trainer ``tr``'s step just done (``rec``: what train_step
    returned) to ``sink`` and the progress line, the loss averaged since the last record."""
    now = time.perf_counter()
    clock.train_s += now - clock.mark
    tps = (tr.tokens_seen - clock.tokens) / max(now - clock.mark, 1e-9)
    mean_loss = sum(clock.window) / len(clock.window)
    record = train_record(tr.step, tr.tokens_seen, rec, mean_loss, tps, tr.tokenizer.byte_level)
    if sink is not None:
        sink.write(record)
    name = "bpc" if "bpc" in record else "ppl"
    progress.update(tr.step, {"loss": mean_loss, name: record[name], "lr": rec["lr"]}, tps,
                    force=force)
    clock.window = []
    clock.resume(tr.tokens_seen)


def log_validation(tr, sink: MetricsSink | None, progress: Progress) -> dict[str, float]:
    """Validate trainer ``tr``'s model, record the result in ``sink`` and say it; returns it.
    Collective in a sharded or expert-parallel run (every process calls it)."""
    t0 = time.perf_counter()
    res = tr.validate()
    name = "bpc" if "bpc" in res else "ppl"
    if sink is not None:
        sink.write({"kind": "valid", "step": tr.step, "tokens": res["tokens"],
                    "loss": res["loss"], name: res[name],
                    "seconds": time.perf_counter() - t0})
    progress.message(f"validation at step {tr.step}: loss {res['loss']:.4f}, {name} "
                     f"{res[name]:.4f} ({res['tokens']} tokens)")
    return res
