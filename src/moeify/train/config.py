"""TrainConfig: everything a training run needs besides the model, as a frozen JSON-able value,
and ``--set key=value`` overrides parsed with type checking.

Override keys:
    lr=1e-3, steps=200, betas=0.9,0.98, ...      a TrainConfig field
    model.d_model=32, model.n_layers=2, ...        a ModelConfig field; d_model and n_layers are
                                                   propagated into every layer config that has
                                                   them (they must agree, ModelConfig checks it)
    model.attention.n_heads=2                      a field of every attention config in the
    model.feedforward.d_ff=64, model.depth.X=...   pattern (likewise feedforward and depth)

Model overrides are kept in ``TrainConfig.model_overrides`` (as "key=value" strings), so the
preset name plus that tuple reproduces the model exactly; the resolved ModelConfig is also written
into the run directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeify.errors import MoeifyError
from moeify.models.config import ModelConfig, known_fields
from moeify.models.presets import find_preset
from moeify.rundir.data import data_difference
from moeify.rundir.files import read_json
from moeify.rundir.layout import CONFIG_FILE
from moeify.train.overrides import (  # noqa: F401  (re-exported: the override API)
    RUN_MODEL_PRESET,
    apply_model_overrides,
    base_model_config,
)
from moeify.train.values import parse_value, split_override  # noqa: F401

AMP_MODES = ("auto", "fp32", "bf16", "fp16")
PARALLEL_MODES = ("ddp", "fsdp")  # moeify.train.plans
AC_MODES = ("none", "block")  # moeify.train.activation_checkpointing
TOKENIZER_CHOICES = ("auto", "byte", "byte256", "sentencepiece", "gpt2")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A training run (SwitchHead appendix), with defaults adapted to the tiny CPU presets.

    The paper's recipe is Adam(W) lr 2.5e-4, betas (0.9, 0.999), no weight decay, cosine decay
    (T_max = 100k) after an optional linear warm-up, 100k steps of batch 64, gradient clipping
    0.1 (small) / 0.25 (big, enwik8), fp16 autocast with a grad scaler: ``paper_recipe(preset)``
    returns it. The defaults below keep the optimiser, schedule shape and clipping style but are
    sized so that ``moeify train`` finishes in about two minutes on two CPU cores: 300 steps of
    16 x 128 bytes with a larger learning rate and clipping 0.25, since a 1M-parameter model
    over 300 steps learns far too little at the paper's 2.5e-4. The learning rate 5e-3 (20
    warm-up steps) was chosen on tiny-switchhead / wiki-excerpt: validation bpc after 100 steps
    was 3.82, 3.66, 3.59, 3.78 for lr 1.5e-3, 3e-3, 6e-3, 1e-2; after 300 steps 3.35 at 1.5e-3
    and 3.23 at 5e-3.

    preset / model_overrides: the model (``moeify presets``); overrides are "key=value" strings.
    model:            a whole ModelConfig as a dict (ModelConfig.to_dict), used instead of the
                      preset's: models that are not presets (``moeify upcycle`` writes one);
                      ``preset`` is then only a name.
    data:             corpus name or local path (moeify.data.corpora); ``moeify train``
                      records a path made absolute (moeify.rundir.data).
    data_sha256:      the fingerprint of the corpus's content (corpus_fingerprint), recorded
                      by ``moeify train``: a resume accepts any path to the same content.
                      A record, not an input; None in runs that did not record it.
    tokenizer:        "auto" = bytes for byte-level corpora (enwik8 convention: the byte values
                      occurring in the train split) and for byte-level presets (a vocabulary of
                      at most 256, such as the tiny-* and repro-* ones) on any corpus,
                      SentencePiece BPE otherwise (paper §3).
    vocab_size:       SentencePiece vocabulary (8000 in the paper); the model's vocab_size is
                      always set to the tokenizer's.
    steps:            optimizer updates.
    batch_size:       sequences per update, over all processes and accumulation steps.
    grad_accum:       micro-batches per update (each process runs batch_size / (W * grad_accum)).
    lr, betas, weight_decay: AdamW; weight decay applies to matrices only (dim >= 2).
    warmup_steps:     linear warm-up; cosine_steps: the cosine's T_max after the warm-up
                      (None: the remaining steps); min_lr_ratio: the cosine's floor / lr.
    grad_clip:        global gradient-norm clipping threshold kappa (0 = off).
    amp:              "auto" (bf16 on CUDA when supported, else fp16 with a grad scaler; fp32 on
                      CPU), or force "fp32" / "bf16" / "fp16".
    device:           "auto" (CUDA when available), "cpu", "cuda", "cuda:1", ...
    seed:             model initialisation and training randomness.
    log_every:        steps between metric records; eval_every: steps between validations
                      (0 = only at the end); eval_tokens: validation tokens scored (0 = the whole
                      split); eval_batch_size: streams scored side by side.
    checkpoint_every: steps between checkpoints (0 = only at the end); keep_checkpoints: how many
                      complete checkpoints stay on disk.
    tensorboard:      also write TensorBoard scalars (the tensorboard extra).
    compile:          torch.compile every block (moeify.train.plans).
    parallel:         with several processes (torchrun): "ddp" replicates the model, "fsdp"
                      shards parameters, gradients and optimizer state per block (FSDP2) and
                      writes sharded checkpoints (moeify.rundir.sharded); "fsdp" also works in one
                      process.
    expert_parallel:  the expert-parallel degree P (moeify.train.expert_parallel): the processes
                      form a 2-D mesh (data-parallel W/P x expert-parallel P); the experts of
                      every sigma-MoE and Switch feedforward are split along dim 0 over the P
                      processes of an expert-parallel group, tokens travel to them by
                      all-to-all. 1 = off. Composes with parallel=ddp (the other parameters
                      replicated) and parallel=fsdp (the other parameters sharded over all
                      processes). Checkpoints are sharded (DCP) and resume at another degree,
                      another process count or in one process.
    activation_checkpointing: "none" or "block" (moeify.train.activation_checkpointing): every
                      block's forward runs again in backward instead of keeping its
                      activations. Composes with compile, parallel=ddp / fsdp and
                      expert_parallel; the same losses, gradients and balancing statistics.
    lr_extensions:    written by a resume with ``--schedule extend|stretch``, not set by hand:
                      each (start, end, factor, phase) replaces the schedule from update
                      ``start`` on by a cosine decay to the floor at update ``end``
                      (moeify.train.schedule).
    init_from:        the checkpoint whose weights this run started from (``--init-from``);
                      None for a run initialised at random. A record, not an input.
    """

    preset: str = "tiny-switchhead"
    model_overrides: tuple[str, ...] = ()
    model: dict[str, Any] | None = None
    data: str = "wiki-excerpt"
    data_sha256: str | None = None
    tokenizer: str = "auto"
    vocab_size: int = 8000
    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 5e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 20
    cosine_steps: int | None = None
    min_lr_ratio: float = 0.0
    grad_clip: float = 0.25
    amp: str = "auto"
    device: str = "auto"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_tokens: int = 65536
    eval_batch_size: int = 16
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    tensorboard: bool = False
    compile: bool = False
    parallel: str = "ddp"
    expert_parallel: int = 1
    activation_checkpointing: str = "none"
    lr_extensions: tuple[tuple[int, int, float, float], ...] = ()
    init_from: str | None = None

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_optimizer()
        self._check_choices()
        self._check_lr_extensions()
        self._check_model()

    def _check_counts(self) -> None:
        positive = ("steps", "batch_size", "grad_accum", "vocab_size", "log_every",
                    "eval_batch_size", "keep_checkpoints")
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("warmup_steps", "eval_every", "eval_tokens", "checkpoint_every", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        if self.cosine_steps is not None and (not isinstance(self.cosine_steps, int)
                                              or self.cosine_steps < 1):
            raise ValueError(f"cosine_steps must be a positive integer or none, got "
                             f"{self.cosine_steps!r}")

    def _check_optimizer(self) -> None:
        for name in ("lr", "weight_decay", "grad_clip", "min_lr_ratio"):
            check_finite_number(name, getattr(self, name))
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0
                                           for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), e.g. betas=0.9,0.999; got "
                             f"{self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0 (grad_clip=0 turns "
                             "clipping off)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")

    def _check_choices(self) -> None:
        if self.amp not in AMP_MODES:
            raise ValueError(f"amp must be one of {', '.join(AMP_MODES)}, got {self.amp!r}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {', '.join(PARALLEL_MODES)}, got "
                             f"{self.parallel!r}")
        if (isinstance(self.expert_parallel, bool) or not isinstance(self.expert_parallel, int)
                or self.expert_parallel < 1):
            raise ValueError(f"expert_parallel must be a positive integer (1 = every process "
                             f"holds every expert), got {self.expert_parallel!r}")
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(f"activation_checkpointing must be one of {', '.join(AC_MODES)}, "
                             f"got {self.activation_checkpointing!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true or false, got {self.compile!r}")
        if self.tokenizer not in TOKENIZER_CHOICES:
            raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZER_CHOICES)}, got "
                             f"{self.tokenizer!r}")

    def _check_lr_extensions(self) -> None:
        try:
            ext = tuple((int(a), int(b), float(f), float(p)) for a, b, f, p in self.lr_extensions)
        except (TypeError, ValueError):
            raise ValueError(f"lr_extensions holds (start, end, factor, phase), got "
                             f"{self.lr_extensions!r}") from None
        if any(not 0 <= a < b or not 0.0 <= f <= 1.0 or not 0.0 <= p <= math.pi
               for a, b, f, p in ext):
            raise ValueError(f"lr_extensions holds (start, end, factor, phase) with 0 <= start < "
                             f"end, 0 <= factor <= 1, 0 <= phase <= pi; got "
                             f"{self.lr_extensions!r}")
        object.__setattr__(self, "lr_extensions", ext)

    def _check_model(self) -> None:
        object.__setattr__(self, "model_overrides", tuple(self.model_overrides))
        if self.model is not None and not isinstance(self.model, dict):
            raise ValueError(f"model must be a ModelConfig dict or none, got "
                             f"{type(self.model).__name__}")
        for o in self.model_overrides:
            if not isinstance(o, str) or "=" not in o:
                raise ValueError(f"model_overrides holds 'key=value' strings, got {o!r}")

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        d["model_overrides"] = list(self.model_overrides)
        d["lr_extensions"] = [list(e) for e in self.lr_extensions]
        for name, default in OPTIONAL_FIELDS.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        return cls(**known_fields(cls, data))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    # ------------------------------------------------------------------ overrides

    def with_overrides(self, overrides: list[str] | tuple[str, ...]) -> "TrainConfig":
        """A copy with ``key=value`` overrides applied (model.* keys are validated against the
        preset's ModelConfig and appended to model_overrides)."""
        changes: dict[str, Any] = {}
        model_ovr = list(self.model_overrides)
        hints = typing.get_type_hints(TrainConfig)
        for item in overrides:
            key, value = split_override(item)
            if key.startswith("model."):
                model_ovr.append(f"{key}={value}")
                continue
            if key not in hints:
                settable = [f.name for f in dataclasses.fields(TrainConfig)
                            if f.name not in ("model", "model_overrides", *WRITTEN_BY_MOEIFY)]
                raise ValueError(f"--set {item}: unknown setting {key!r}; train settings are "
                                 f"{', '.join(settable)}"
                                 ", model settings start with model. (e.g. model.d_model=64)")
            if key in ("model_overrides", "model"):
                raise ValueError(f"set model fields with model.<field>=value, not {key}")
            if key in WRITTEN_BY_MOEIFY:
                raise ValueError(f"--set {item}: {key} is recorded by moeify, not set by hand ("
                                 + WRITTEN_BY_MOEIFY[key] + ")")
            changes[key] = parse_value(value, hints[key], what=f"--set {item}")
        out = dataclasses.replace(self, **changes, model_overrides=tuple(model_ovr))
        if len(model_ovr) > len(self.model_overrides) and (
                out.model is not None or out.preset != RUN_MODEL_PRESET):
            apply_model_overrides(base_config_of(out), model_ovr)  # fail early
        return out


# ---------------------------------------------------------------------- the run's model

def base_config_of(cfg: TrainConfig, run_dir=None) -> ModelConfig:
    """The run's model before overrides: ``cfg.model`` when given (a converted model written
    whole into the training config), else the preset's (``run_dir`` for RUN_MODEL_PRESET)."""
    if cfg.model is not None:
        return ModelConfig.from_dict(cfg.model)
    return base_model_config(cfg.preset, run_dir)


def resolve_model_config(cfg: TrainConfig, vocab_size: int | None = None,
                         run_dir=None) -> ModelConfig:
    """The preset's ModelConfig with the overrides applied and the tokenizer's vocabulary
    (``run_dir``: the run being resumed, whose model.json the preset "run-model" names)."""
    model = apply_model_overrides(base_config_of(cfg, run_dir), cfg.model_overrides)
    if vocab_size is not None and vocab_size != model.vocab_size:
        model = dataclasses.replace(model, vocab_size=vocab_size)
    return model


# Written to JSON only when they differ from their default, so that config.json, checkpoint
# records and compare/sweep run specs of runs without them read exactly as before they existed
# (a sweep refuses a run directory whose recorded settings differ from its own).
OPTIONAL_FIELDS = {"lr_extensions": [], "init_from": None, "expert_parallel": 1,
                   "data_sha256": None, "activation_checkpointing": "none"}

# Fields moeify writes itself, with what writes them.
WRITTEN_BY_MOEIFY = {"lr_extensions": "moeify train --resume RUN --steps N --schedule extend|"
                                      "stretch",
                     "init_from": "moeify train --init-from RUN",
                     "data_sha256": "moeify train, from the content of --data"}


# The largest float32: settings become float32 tensors inside the optimizer and the scheduler.
FLOAT32_MAX = 3.4028234663852886e38


def check_finite_number(name: str, value: Any) -> None:
    """A ValueError unless ``value`` is a real number a float32 tensor can hold (no nan/inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value or abs(value) > FLOAT32_MAX:
        raise ValueError(f"{name} must be a finite number (at most {FLOAT32_MAX:.3g} in size), "
                         f"got {value!r}")


def paper_recipe(preset: str, **changes: Any) -> TrainConfig:
    """The published training recipe for a paper preset (SwitchHead appendix): Adam lr 2.5e-4,
    100k steps of cosine decay, fp16; batch size, warm-up and clipping from the preset's row."""
    row = find_preset(preset)
    if row.recipe is None:
        raise ValueError(f"preset {preset!r} is not a paper row (it has no published recipe); "
                         "choose one of the paper presets (`moeify presets`)")
    recipe = dict(
        preset=preset, steps=100_000, cosine_steps=100_000, lr=2.5e-4, betas=(0.9, 0.999),
        weight_decay=0.0, batch_size=row.recipe.batch_size,
        warmup_steps=row.recipe.warmup_steps, grad_clip=row.recipe.grad_clip, amp="fp16",
        data=row.data, eval_every=5000, checkpoint_every=5000, log_every=100, eval_tokens=0)
    recipe.update(changes)
    return TrainConfig(**recipe)


# Settings that may change when a run is resumed: they do not change what is learnt up to the
# checkpoint (steps extends or shortens the run; what the schedule does then is
# moeify.train.schedule.resume_schedule's decision, which also checks SCHEDULE_FIELDS).
RESUMABLE_CHANGES = ("steps", "log_every", "eval_every", "eval_tokens", "eval_batch_size",
                     "checkpoint_every", "keep_checkpoints", "tensorboard", "device", "compile",
                     "parallel", "expert_parallel", "activation_checkpointing")
# The schedule's shape after the warm-up: it may change on resume for the steps still to come.
SCHEDULE_FIELDS = ("cosine_steps", "lr_extensions")
# Compared by what they identify: the model above, the data by content (data_difference).
_IDENTITY_FIELDS = ("preset", "model_overrides", "data", "data_sha256")


def check_resume_compatible(saved: TrainConfig, requested: TrainConfig, *,
                            weights_only: bool = False, run_dir: str | Path | None = None
                            ) -> None:
    """Raise if ``requested`` changes something a resumed run cannot change. From a checkpoint
    that holds only weights (an imported model: nothing trained yet) only the model is fixed.
    The data may be given by any path to the same content (moeify.rundir.data; ``run_dir``
    finds a relative path recorded as typed)."""
    if (saved.preset != requested.preset or saved.model_overrides != requested.model_overrides
            or saved.model != requested.model):
        raise ValueError(f"the checkpoint is from another preset: the run was trained as "
                         f"{saved.preset!r} {list(saved.model_overrides) or ''} but "
                         f"{requested.preset!r} {list(requested.model_overrides) or ''} was "
                         "requested; resume without --preset/model overrides, or start a new run "
                         "with --out")
    if weights_only:
        return
    bad = [f.name for f in dataclasses.fields(TrainConfig)
           if f.name not in RESUMABLE_CHANGES + SCHEDULE_FIELDS + _IDENTITY_FIELDS
           and getattr(saved, f.name) != getattr(requested, f.name)]
    if bad:
        raise ValueError(f"cannot change {', '.join(bad)} when resuming (the run was trained with "
                         + ", ".join(f"{b}={getattr(saved, b)!r}" for b in bad)
                         + "); only " + ", ".join(RESUMABLE_CHANGES) + " may change. Start a "
                         "new run with --out to train with different settings")
    problem = data_difference(saved.data, saved.data_sha256, requested.data,
                              requested.data_sha256, run_dir)
    if problem is not None:
        raise ValueError(problem)


def read_train_config(run_dir: str | Path) -> TrainConfig:
    """A run directory's config.json as a TrainConfig, or a MoeifyError naming the file when it
    is missing or not a valid training configuration."""
    path = Path(run_dir) / CONFIG_FILE
    data = read_json(path, "training configuration")
    try:
        return TrainConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        raise MoeifyError(f"{path} is not a valid training configuration ({e})") from None
