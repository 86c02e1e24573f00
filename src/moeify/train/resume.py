"""Before a run starts or resumes: checking its run directory (a fresh run refuses a directory
that holds checkpoints; a resume finds its checkpoint, checks that the requested settings are
ones a resumed run can honour, and settles the learning-rate schedule for a changed length:
moeify.train.schedule.resume_schedule), and its corpus and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moeify.data.corpora import load_corpus
from moeify.data.tokenizers import build_tokenizer, load_tokenizer
from moeify.errors import MoeifyError
from moeify.rundir import layout
from moeify.rundir.checkpoints import read_meta
from moeify.train.config import TrainConfig, check_resume_compatible, read_train_config
from moeify.train.distributed import DistEnv
from moeify.train.overrides import BYTE_VOCAB, byte_level_preset
from moeify.train.schedule import resume_schedule


@dataclass
class ResumePoint:
    checkpoint: Path | None        # None: a fresh run
    cfg: TrainConfig               # the settings to run with (a resume may change the schedule)
    schedule_note: str | None = None
    weights_only: bool = False     # a checkpoint of weights alone (an import): step 0
    recorded: TrainConfig | None = None  # the settings the checkpoint was trained with


def check_run_dir(run_dir: Path, cfg: TrainConfig, resume: bool | str | Path,
                  schedule: str | None) -> ResumePoint:
    """Where a run in ``run_dir`` starts (module docstring); MoeifyError or ValueError when the
    directory or the settings do not allow it."""
    if resume is False or resume is None:
        if layout.checkpoint_dirs(run_dir):
            raise MoeifyError(f"{run_dir} already holds a run with checkpoints; pass "
                              "--resume to continue it, or --out to start a new run")
        return ResumePoint(None, cfg)
    target = run_dir if resume is True else Path(resume)
    ckpt = layout.resolve_checkpoint(target)
    if layout.run_dir_of(ckpt).resolve() != run_dir.resolve():
        raise MoeifyError(f"checkpoint {ckpt} belongs to run {layout.run_dir_of(ckpt)}, not "
                          f"{run_dir}; resume it with --out {layout.run_dir_of(ckpt)}")
    meta = read_meta(ckpt)
    weights_only = bool(meta.get("weights_only"))
    trained = trained_config(run_dir, ckpt, meta)
    check_resume_compatible(trained, cfg, weights_only=weights_only, run_dir=run_dir)
    step = int(meta["step"])
    if step >= cfg.steps:
        raise MoeifyError(
            f"{run_dir} has already trained {step} steps (checkpoint {ckpt.name}), so "
            f"--steps {cfg.steps} leaves nothing to do: give --steps above {step} to "
            "train further")
    note = None
    if not weights_only:
        cfg, note = resume_schedule(trained, cfg, step, schedule)
    return ResumePoint(ckpt, cfg, note, weights_only, trained)


def trained_config(run_dir: Path, ckpt: Path, meta: dict) -> TrainConfig:
    """The settings the checkpoint was trained with. config.json must still agree with them
    (an edit there is refused, not silently ignored: the optimizer state would override it);
    checkpoints that record no settings are compared with config.json alone."""
    on_disk = read_train_config(run_dir)
    recorded = meta.get("train_config")
    if not isinstance(recorded, dict):
        return on_disk
    try:
        trained = TrainConfig.from_dict(recorded)
    except (TypeError, ValueError):
        return on_disk
    try:
        check_resume_compatible(trained, on_disk, run_dir=run_dir)
    except ValueError as e:
        raise MoeifyError(
            f"{run_dir / 'config.json'} was edited after checkpoint {ckpt.name} was "
            f"written, and a resumed run cannot honour that: {e}") from None
    return trained


def corpus_and_tokenizer(cfg: TrainConfig, env: DistEnv, resumed_run: Path | None, given=None):
    """The run's corpus and tokenizer (process 0 fills the caches first): a resumed run's own
    tokenizer, ``given`` (a model's, for a run that continues its training), or one built from
    the corpus as ``cfg.tokenizer`` says."""
    corpus = env.rank0_first(lambda: load_corpus(cfg.data))
    if resumed_run is not None:
        return corpus, load_tokenizer(resumed_run)
    if given is not None:
        return corpus, given
    kind = cfg.tokenizer
    if kind == "auto":
        byte_model = (cfg.model["vocab_size"] <= BYTE_VOCAB if cfg.model
                      else byte_level_preset(cfg.preset))
        kind = "byte" if corpus.byte_level or byte_model else "sentencepiece"
    return corpus, env.rank0_first(lambda: build_tokenizer(kind, corpus,
                                                           vocab_size=cfg.vocab_size))
