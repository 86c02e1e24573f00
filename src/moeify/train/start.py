"""Starting a run from weights that exist already: a model in memory (upcycling, imports) or
another run's checkpoint (``--init-from``). The new run has the training state of a fresh run:
new optimizer and schedule, the data at its start, the RNG as a fresh run seeds it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TextIO

import torch

from moeify.data.cache import quiet_progress
from moeify.errors import MoeifyError
from moeify.rundir import layout
from moeify.rundir.checkpoints import Checkpoint
from moeify.rundir.files import model_config_dict, read_model_config
from moeify.rundir.layout import CONFIG_FILE
from moeify.rundir.model import load_trained
from moeify.train.config import TrainConfig, read_train_config, resolve_model_config
from moeify.train.distributed import device_type, process_group
from moeify.train.metrics import MetricsSink
from moeify.train.progress import Progress
from moeify.train.reporting import log_validation
from moeify.train.trainer import Trainer, TrainResult, train


def start_run_from_model(cfg: TrainConfig, run_dir: str | Path, model: torch.nn.Module,
                         tokenizer, *, validate: bool = True, quiet: bool = True,
                         stream: TextIO | None = None) -> dict[str, float] | None:
    """A new run whose step-0 checkpoint holds ``model``'s weights (``cfg`` must resolve to its
    ModelConfig, e.g. through ``cfg.model``), with the training state of a fresh run: new
    optimizer and schedule, the data at its start, the RNG as a fresh run seeds it. So
    ``train(cfg, run_dir, resume=True)`` trains exactly as a fresh run that started from these
    weights would. With ``validate`` the validation loss at step 0 is measured and recorded in
    metrics.jsonl (and returned)."""
    trainer = Trainer(cfg, run_dir, quiet=quiet, stream=stream, tokenizer=tokenizer)
    try:
        if model_config_dict(trainer.model_cfg) != model_config_dict(model.config):
            raise MoeifyError("the training configuration does not describe this model; pass "
                              "TrainConfig(model=model.config.to_dict(), ...)")
        # The full weights into this run's layout (this process's shards under FSDP or EP).
        trainer.plan.load_full_state(trainer.model, Checkpoint(
            path=Path(run_dir), step=0, model_state=model.state_dict(), train_state={}, meta={}),
            None, trainer.optimizer)
        valid = None
        # A sharded or expert-parallel forward is collective: every process validates then.
        if validate and (trainer.env.is_main or trainer.sharded):
            sink = (MetricsSink(trainer.run_dir, tensorboard=False) if trainer.env.is_main
                    else None)
            try:
                progress = Progress(cfg.steps, 0, stream=trainer.stream,
                                    enabled=not trainer.quiet)
                valid = log_validation(trainer, sink, progress)
            finally:
                if sink is not None:
                    sink.close()
        trainer.save_checkpoint()
        return valid
    finally:
        trainer.close()


def init_config(source: str | Path) -> TrainConfig:
    """The settings a new run started from ``source``'s weights begins with (``--init-from``):
    the source run's own training settings, its model as a whole ModelConfig, a fresh schedule
    over ``steps``, and ``init_from`` naming the checkpoint. Change data, lr, steps, ... on the
    result (dataclasses.replace, with_overrides)."""
    ckpt = layout.resolve_checkpoint(source)
    src_run = layout.run_dir_of(ckpt)
    base = read_train_config(src_run) if (src_run / CONFIG_FILE).is_file() else TrainConfig()
    model = read_model_config(src_run)
    # How the source was spread over processes is not the new run's business: its parallelism
    # comes from this command line (--set parallel=..., expert_parallel=...), default one
    # process's.
    fresh = TrainConfig()
    return dataclasses.replace(base, model=model.to_dict(), model_overrides=(),
                               cosine_steps=None, lr_extensions=(),
                               parallel=fresh.parallel, expert_parallel=fresh.expert_parallel,
                               init_from=str(ckpt.resolve()))


def train_from(cfg: TrainConfig, run_dir: str | Path, source: str | Path, *, quiet: bool = False,
               stream: TextIO | None = None) -> TrainResult:
    """Train a new run in ``run_dir`` that starts from the weights of run (or checkpoint)
    ``source``, with its tokenizer, under ``cfg`` (``init_config(source)`` with changes): a
    fresh optimizer, schedule and data position. ``cfg``'s model overrides may change what does
    not change a weight's shape (dropout, implementations)."""
    src = load_trained(source, "cpu")
    model_cfg = resolve_model_config(cfg, src.tokenizer.vocab_size)
    model = model_cfg.build()
    try:
        model.load_state_dict(src.model.state_dict(), strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        raise MoeifyError(f"the weights of {src.run_dir} do not fit the model these settings "
                          f"describe ({first}); change only settings that keep the weights' "
                          "shapes, or use moeify upcycle to convert the architecture") from None
    cfg = dataclasses.replace(cfg, model=model_cfg.to_dict(), model_overrides=())
    # One process group for both trainers (moeify.train.distributed.process_group).
    with process_group(device_type(cfg.device)):
        with quiet_progress(quiet):
            start_run_from_model(cfg, run_dir, model, src.tokenizer, validate=False,
                                 quiet=True, stream=stream)
        return train(cfg, run_dir, resume=True, quiet=quiet, stream=stream)
