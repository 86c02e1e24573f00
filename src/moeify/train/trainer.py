"""The training loop (switchhead.md §3): AdamW, warm-up + cosine, clipping, accumulation,
autocast, XL memory across steps, validation, atomic checkpoints, exact resume, data parallel.

Shape legend: B rows of this process per update, b rows per micro-batch (B / grad_accum),
T tokens per row (the model's context length), D d_model, L layers, W processes.

One update: the process's [B, T+1] window is cut into grad_accum micro-batches of b rows; each
runs forward with its rows of the XL memory (the previous window's block inputs, detached) and
backward with loss / grad_accum (the model's aux losses, already weighted, are added); then the
gradients are averaged over processes (DDP, or FSDP2 with parallel=fsdp: moeify.train.parallel),
clipped to norm kappa, and AdamW steps. Every
micro-batch has the same number of tokens, so this equals one big batch: W processes with B rows
each compute the update of one process with W*B rows (tests/train/test_distributed.py).

Exactness of resume: the checkpoint holds everything the next update reads (weights, AdamW
moments, schedule position, grad-scaler state, data position, every process's RNG state and the
XL memory of every row), so a resumed run repeats the uninterrupted run's losses bit for bit on
the same hardware and process count.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist

from moeify.data.cache import quiet_progress
from moeify.data.corpora import load_corpus
from moeify.data.stream import StreamBatcher, tokenize_split
from moeify.data.tokenizers import build_tokenizer, load_tokenizer
from moeify.errors import MoeifyError, describe_os_error
from moeify.layers.common import upgrade_legacy_keys
from moeify.ops.optim import adamw
from moeify.rundir import checkpoints as ckpt_read
from moeify.rundir import layout
from moeify.rundir.atomic import write_json_atomic
from moeify.rundir.files import model_config_dict, read_model_config, write_run_files
from moeify.rundir.layout import CONFIG_FILE
from moeify.rundir.model import load_trained
from moeify.train import checkpoint as ckpt_io
from moeify.train.config import (TrainConfig, check_resume_compatible, read_train_config,
                                 resolve_model_config)
from moeify.train import parallel
from moeify.train.balancing import Balancing
from moeify.train import sharded as sharded_io
from moeify.train.distributed import (DistEnv, PeerLost, peer_lost_message, pick_device,
                                      setup_distributed)
from moeify.train.expert_parallel import ExpertParallel
from moeify.train.lock import RunLock
from moeify.train.metrics import MetricsSink, summarise_tensor, truncate_metrics
from moeify.train.overrides import BYTE_VOCAB, byte_level_preset
from moeify.train.progress import Progress, format_duration
from moeify.train.schedule import make_scheduler, resume_schedule, schedule_factor
from moeify.train.signals import StopRequests
from moeify.train.validate import autocast_context, evaluate_stream


class NonFiniteLoss(MoeifyError):
    """The loss became NaN or infinite; the run stopped before updating the weights."""


@dataclass
class _Clock:
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


def resolve_amp(mode: str, device: torch.device) -> tuple[torch.dtype | None, bool]:
    """(autocast dtype or None, use a grad scaler). ``auto``: bf16 on CUDA when supported, else
    fp16 with a scaler as in the paper; fp32 on CPU (CPU autocast is slower than fp32 here)."""
    if mode == "fp32" or (mode == "auto" and device.type != "cuda"):
        return None, False
    if mode == "auto":
        return (torch.bfloat16, False) if torch.cuda.is_bf16_supported() else (torch.float16, True)
    if mode == "bf16":
        return torch.bfloat16, False
    if device.type != "cuda":
        raise ValueError("amp=fp16 needs a CUDA device (it uses a grad scaler); on CPU use "
                         "amp=bf16 or amp=fp32")
    return torch.float16, True


def _rng_state(device: torch.device) -> dict[str, Any]:
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "mps": torch.mps.get_rng_state() if device.type == "mps" else None,
            "python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                      int(np_state[2]), int(np_state[3]), float(np_state[4])]}


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if state.get("mps") is not None and device.type == "mps":
        torch.mps.set_rng_state(state["mps"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))


class Trainer:
    """Set up a run (fresh or resumed) in ``run_dir``; ``fit()`` trains it."""

    def __init__(self, cfg: TrainConfig, run_dir: str | Path, *, resume: bool | str | Path = False,
                 quiet: bool = False, stream: TextIO | None = None, tokenizer=None,
                 schedule: str | None = None) -> None:
        """``tokenizer``: use this one in a fresh run instead of building one from the corpus
        (a run that continues another model's training keeps that model's tokenizer).
        ``schedule``: on a resume with another ``steps``, what the learning-rate schedule does
        (keep, extend, stretch: moeify.train.schedule.resume_schedule)."""
        self.cfg = cfg
        self.schedule_choice = schedule
        self.schedule_note: str | None = None
        self._given_tokenizer = tokenizer
        self.run_dir = Path(run_dir)
        self.stream = stream if stream is not None else sys.stderr
        device_type = "cuda" if cfg.device.startswith("cuda") or (
            cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
        self.env: DistEnv = setup_distributed(device_type, single=cfg.parallel == "fsdp")
        self.lock = RunLock(self.run_dir)
        # A refused start leaves no directory behind that it created (moeify train on an
        # unusable device, a bad setting found late, ...), parents such as runs/ included.
        created = [p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]
        try:
            # Before the run directory is touched: a device this machine lacks is a refusal.
            self.device = pick_device(cfg.device, self.env)
            self._lock_run_dir()
            self._setup(resume, quiet)
        except BaseException:
            self.close()  # a process group or lock this run took must not outlive it
            if self.env.is_main:
                for path in created:  # innermost first; stops at the first one not empty
                    if not _remove_if_empty(path):
                        break
            raise

    def _lock_run_dir(self) -> None:
        """Process 0 locks the run directory (and sweeps what crashed writers left there)."""
        error = None
        if self.env.is_main:
            if self.run_dir.exists() and not self.run_dir.is_dir():
                error = (f"--out {self.run_dir} is a file, not a directory: give a new or "
                         "existing run directory")
            else:
                try:
                    self.lock.acquire()
                    if (self.run_dir / layout.CHECKPOINTS).is_dir():
                        ckpt_io.sweep_stale(self.run_dir / layout.CHECKPOINTS)
                except MoeifyError as e:
                    error = str(e)
                except OSError as e:  # e.g. a read-only file system
                    error = f"cannot use the run directory: {describe_os_error(e)}"
        error = self.env.broadcast_object(error)
        if error is not None:
            raise MoeifyError(error)

    def _setup(self, resume: bool | str | Path, quiet: bool) -> None:
        """Everything before the first step, in an order that matters: the run directory is
        checked (and a resume settles the schedule) before the data and the model are made;
        the seeds are set around building the model; expert parallelism and DDP/FSDP wrap the
        model before the optimizer sees its parameters; the run's files are written last."""
        self.quiet = quiet or not self.env.is_main
        self.amp_dtype, use_scaler = resolve_amp(self.cfg.amp, self.device)
        self._split_batch()
        ckpt_dir = self._check_run_dir(resume)
        cfg = self.cfg  # a resume may have settled the schedule (_check_run_dir)
        self.corpus, self.tokenizer = self._data(resume=ckpt_dir is not None)
        self._resolve_model(cfg, resumed=ckpt_dir is not None)
        self._build_model(cfg)
        self._build_optimizer(cfg, use_scaler)
        self._load_tokens()
        self.memory: list[torch.Tensor] | None = None
        self.step = 0
        self.tokens_seen = 0
        self.last_checkpoint: Path | None = None
        if ckpt_dir is not None:
            self._restore(ckpt_dir)
            if self.env.is_main:  # the file tells the settings this continuation runs with
                write_json_atomic(self.run_dir / "config.json", cfg.to_dict())
        elif self.env.is_main:
            write_run_files(self.run_dir, cfg, self.model_cfg, self.tokenizer)
            truncate_metrics(self.run_dir, 0)  # records of an earlier attempt without checkpoints
        self.env.barrier()

    def _split_batch(self) -> None:
        """Rows per process (``self.rows``) and per micro-batch (``self.micro``)."""
        cfg, W = self.cfg, self.env.world_size
        if cfg.batch_size % (W * cfg.grad_accum):
            raise ValueError(f"batch_size={cfg.batch_size} must be divisible by processes x "
                             f"grad_accum = {W} x {cfg.grad_accum}; change batch_size or "
                             "grad_accum")
        self.rows = cfg.batch_size // W
        self.micro = self.rows // cfg.grad_accum

    def _resolve_model(self, cfg: TrainConfig, *, resumed: bool) -> None:
        """``self.model_cfg`` (the tokenizer's vocabulary), checked against the run's
        model.json when resuming."""
        self.model_cfg = resolve_model_config(cfg, self.tokenizer.vocab_size, self.run_dir)
        if resumed:
            saved_model = read_model_config(self.run_dir)
            if model_config_dict(saved_model) != model_config_dict(self.model_cfg):
                raise MoeifyError(f"the checkpoint is from another model configuration than "
                                  f"{cfg.preset!r} with the requested overrides; resume with the "
                                  "run's own settings or start a new run with --out")
        self.T = self.model_cfg.context_length

    def _build_model(self, cfg: TrainConfig) -> None:
        """The model on the device (``self.model``) and the module the steps run
        (``self.train_model``: compiled, sharded or DDP-wrapped)."""
        torch.manual_seed(cfg.seed)  # identical initial weights in every process
        self.model = self.model_cfg.build().to(self.device)
        torch.manual_seed(cfg.seed + 1 + self.env.rank)  # per-process dropout randomness
        # Expert parallelism: the expert weights become Shard(0) DTensors over the "ep" mesh
        # dimension (before DDP or FSDP, which must leave them alone, and before the
        # optimizer, which must see the shards).
        self.ep = None
        if cfg.expert_parallel > 1:
            self.ep = ExpertParallel(self.model, cfg.expert_parallel, self.device)
        # Compiled and/or sharded in place, or wrapped by DDP; before the optimizer, which must
        # see the sharded parameters under FSDP.
        self.train_model: torch.nn.Module = parallel.parallelize(
            self.model, cfg.parallel, device=self.device, distributed=self.env.enabled,
            compile=cfg.compile,
            expert_params=None if self.ep is None else list(self.ep.params.values()))
        # Sharded (DCP) checkpoints, and a forward that is collective: FSDP or EP.
        self.sharded = cfg.parallel == "fsdp" or self.ep is not None
        self.balancing = Balancing(self.model, self.env)

    def _build_optimizer(self, cfg: TrainConfig, use_scaler: bool) -> None:
        """AdamW (no weight decay on vectors), the learning-rate schedule, the grad scaler."""
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = adamw(  # fused where torch can (moeify.ops.optim)
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas,
            # torch's foreach kernels (its default on GPUs) refuse a list that mixes plain
            # tensors with DTensors, or DTensors of two meshes, as expert parallelism's groups do
            foreach=False if self.ep is not None else None)
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=use_scaler)

    def _load_tokens(self) -> None:
        """The tokenised splits (process 0 fills the cache first) and the training batcher."""
        self.train_tokens = self._rank0_first(lambda: tokenize_split(self.corpus, self.tokenizer,
                                                                     "train"))
        self.valid_tokens = self._rank0_first(lambda: tokenize_split(self.corpus, self.tokenizer,
                                                                     "valid"))
        self.batcher = StreamBatcher(self.train_tokens, self.rows, self.T,
                                     rank=self.env.rank, world_size=self.env.world_size)

    # ------------------------------------------------------------------ setup helpers

    def _rank0_first(self, fn):
        """Run ``fn`` on process 0 first (it fills the caches), then on the others. When it
        fails on process 0 every process raises, instead of the others waiting forever."""
        if not self.env.enabled:
            return fn()
        out, error, exc = None, None, None
        if self.env.is_main:
            try:
                out = fn()
            except Exception as e:  # re-raised below, after telling the other processes
                error, exc = str(e), e
        error = self.env.broadcast_object(error)
        if exc is not None:
            raise exc
        if error is not None:
            raise MoeifyError(f"process 0 failed while preparing the data: {error}")
        return out if self.env.is_main else fn()

    def _check_run_dir(self, resume: bool | str | Path) -> Path | None:
        self.weights_only = False
        if resume is False or resume is None:
            if layout.checkpoint_dirs(self.run_dir):
                raise MoeifyError(f"{self.run_dir} already holds a run with checkpoints; pass "
                                  "--resume to continue it, or --out to start a new run")
            return None
        target = self.run_dir if resume is True else Path(resume)
        ckpt = layout.resolve_checkpoint(target)
        if layout.run_dir_of(ckpt).resolve() != self.run_dir.resolve():
            raise MoeifyError(f"checkpoint {ckpt} belongs to run {layout.run_dir_of(ckpt)}, not "
                              f"{self.run_dir}; resume it with --out {layout.run_dir_of(ckpt)}")
        self.weights_only = bool(ckpt_read.read_meta(ckpt).get("weights_only"))
        trained = self._trained_config(ckpt)
        check_resume_compatible(trained, self.cfg,
                                weights_only=self.weights_only, run_dir=self.run_dir)
        step = int(ckpt_read.read_meta(ckpt)["step"])
        if step >= self.cfg.steps:
            raise MoeifyError(
                f"{self.run_dir} has already trained {step} steps (checkpoint {ckpt.name}), so "
                f"--steps {self.cfg.steps} leaves nothing to do: give --steps above {step} to "
                "train further")
        if not self.weights_only:
            self.cfg, self.schedule_note = resume_schedule(
                trained, self.cfg, step, self.schedule_choice)
        return ckpt

    def _trained_config(self, ckpt: Path) -> TrainConfig:
        """The settings the checkpoint was trained with. config.json must still agree with them
        (an edit there is refused, not silently ignored: the optimizer state would override it);
        checkpoints that record no settings are compared with config.json alone."""
        on_disk = read_train_config(self.run_dir)
        recorded = ckpt_read.read_meta(ckpt).get("train_config")
        if not isinstance(recorded, dict):
            return on_disk
        try:
            trained = TrainConfig.from_dict(recorded)
        except (TypeError, ValueError):
            return on_disk
        try:
            check_resume_compatible(trained, on_disk, run_dir=self.run_dir)
        except ValueError as e:
            raise MoeifyError(
                f"{self.run_dir / 'config.json'} was edited after checkpoint {ckpt.name} was "
                f"written, and a resumed run cannot honour that: {e}") from None
        return trained

    def _data(self, *, resume: bool):
        corpus = self._rank0_first(lambda: load_corpus(self.cfg.data))
        if resume:
            return corpus, load_tokenizer(self.run_dir)
        if self._given_tokenizer is not None:
            return corpus, self._given_tokenizer
        kind = self.cfg.tokenizer
        if kind == "auto":
            byte_model = (self.cfg.model["vocab_size"] <= BYTE_VOCAB if self.cfg.model
                          else byte_level_preset(self.cfg.preset))
            kind = "byte" if corpus.byte_level or byte_model else "sentencepiece"
        tok = self._rank0_first(lambda: build_tokenizer(kind, corpus,
                                                        vocab_size=self.cfg.vocab_size))
        return corpus, tok

    # ------------------------------------------------------------------ checkpoints

    def _restore(self, ckpt_dir: Path) -> None:
        if ckpt_read.is_sharded_checkpoint(ckpt_dir):
            st = sharded_io.restore_sharded(ckpt_dir, self.model, self.optimizer,
                                            model_config=model_config_dict(self.model_cfg))
        else:
            if self.cfg.parallel == "fsdp":
                raise MoeifyError(f"{ckpt_dir} is a single-file checkpoint; resume it with "
                                  "parallel=ddp (sharded runs resume sharded checkpoints)")
            ckpt = ckpt_read.load_checkpoint(ckpt_dir, map_location="cpu",
                                           model_config=model_config_dict(self.model_cfg))
            st = ckpt.train_state
            if self.ep is not None:  # full experts on disk: keep this process's rows
                model_state, opt_state = self.ep.load_full_state(
                    ckpt.model_state, st.get("optimizer"), self.optimizer)
                ckpt = dataclasses.replace(ckpt, model_state=model_state)
                if opt_state is not None:
                    st = {**st, "optimizer": opt_state}
            ckpt_read.load_model_state(self.model, ckpt)
            if self.weights_only:
                # Weights without a training state (moeify import): training starts at step 0
                # with a fresh optimizer and data position, under the settings of this
                # invocation.
                self.last_checkpoint = ckpt.path
                if self.env.is_main:
                    write_json_atomic(self.run_dir / CONFIG_FILE, self.cfg.to_dict())
                    truncate_metrics(self.run_dir, 0)
                return
        try:
            if "optimizer" in st:
                self.optimizer.load_state_dict(st["optimizer"])
            self.scheduler.load_state_dict(st["scheduler"])
            # The optimizer's state holds the rate the old schedule set for the next update;
            # this run's schedule (changed by resume_schedule, or the same) decides it.
            factor = schedule_factor(self.cfg, int(st["step"]))
            for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
                group["lr"] = base * factor
            self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
            if self.scaler.is_enabled() and st.get("scaler"):
                self.scaler.load_state_dict(st["scaler"])
            self.batcher.load_state_dict(st["data"])
            rngs = st["rng"]
            _set_rng_state(rngs[self.env.rank % len(rngs)], self.device)
            mem = st.get("memory")
            if mem is not None:
                lo = self.env.rank * self.rows
                self.memory = [m[lo:lo + self.rows].to(self.device) for m in mem]
            self.step = int(st["step"])
            self.tokens_seen = int(st.get("tokens_seen", 0))
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            raise MoeifyError(f"checkpoint {ckpt_dir} has an unusable training state ({e}); "
                              "use an earlier checkpoint") from None
        self.last_checkpoint = ckpt_dir
        if self.env.is_main:
            truncate_metrics(self.run_dir, self.step)

    def save_checkpoint(self) -> Path | None:
        """Collective: every process contributes its RNG state and XL memory rows (and, in a
        sharded run, writes its shards). A process that dies meanwhile makes the others stop
        with one line (peer_lost_message); the previous checkpoint stays intact."""
        previous = self.last_checkpoint
        try:
            return self._save_checkpoint()
        except RuntimeError as e:  # PeerLost, or the process group's own error in a collective
            if not (isinstance(e, PeerLost) or _is_peer_error(e)):
                raise
            kind = "sharded checkpoint" if self.sharded else "checkpoint"
            raise MoeifyError(peer_lost_message(
                self.env.rank, self.env.world_size, f"the {kind} of step {self.step}", previous,
                self.run_dir)) from None

    def _save_checkpoint(self) -> Path | None:
        rngs = self.env.all_gather_object(_rng_state(self.device))
        mem_local = None if self.memory is None else [m.detach().cpu() for m in self.memory]
        mems = self.env.all_gather_object(mem_local)
        meta = {"preset": self.cfg.preset, "model_config": model_config_dict(self.model_cfg),
                "train_config": self.cfg.to_dict()}
        state = None
        if self.env.is_main:
            memory = None if any(m is None for m in mems) else [
                torch.cat([m[i] for m in mems], 0) for i in range(len(mems[0]))]
            state = {"step": self.step, "scheduler": self.scheduler.state_dict(),
                     "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
                     "data": self.batcher.state_dict(), "rng": rngs, "memory": memory,
                     "tokens_seen": self.tokens_seen, "world_size": self.env.world_size}
        if self.sharded:  # the optimizer state goes into the shards (moeify.train.sharded)
            try:
                self.last_checkpoint = sharded_io.save_sharded(
                    self.env, self.run_dir, self.step, self.model, self.optimizer, state,
                    meta={**meta, "world_size": self.env.world_size,
                          "expert_parallel": self.cfg.expert_parallel},
                    keep=self.cfg.keep_checkpoints)
            except ckpt_read.NonFiniteState as e:  # raised on every process
                raise MoeifyError(f"{e}. {self._last_good()}") from None
            return self.last_checkpoint
        error = None
        path = None
        if self.env.is_main:
            state["optimizer"] = self.optimizer.state_dict()
            try:
                path = ckpt_io.save_checkpoint(self.run_dir, self.step, self.model.state_dict(),
                                               state, meta=meta, keep=self.cfg.keep_checkpoints)
            except ckpt_read.NonFiniteState as e:
                error = f"{e}. {self._last_good()}"
            except OSError as e:
                error = (f"writing checkpoint step {self.step} failed: {describe_os_error(e)}. "
                         f"{self._last_good()}")
        error = self.env.broadcast_object(error)
        if error is not None:
            raise MoeifyError(error)
        self.last_checkpoint = path
        return path

    def _diverged(self, what: str) -> None:
        """Stop on a non-finite loss. A checkpoint of the weights that produced it is not good:
        it is set aside (checkpoints/diverged-step-N) and ``latest`` moves back."""
        aside = ""
        last = self.last_checkpoint
        # Every process reaches here (the losses are agreed); a sharded comparison is collective.
        if (self.env.is_main or self.sharded) and last is not None \
                and self._holds_current_weights(last):
            if self.env.is_main:
                moved = ckpt_io.set_aside(last)
                aside = (f" Checkpoint {last.name} holds these weights, so it was set aside as "
                         f"{moved}.")
                self.last_checkpoint = layout.latest_checkpoint(self.run_dir)
            if self.sharded:
                self.last_checkpoint = self.env.broadcast_object(self.last_checkpoint)
        raise NonFiniteLoss(f"{what}. Lower the learning rate (lr={self.cfg.lr}) or grad_clip, "
                            f"or train in fp32 (amp=fp32).{aside} "
                            + self._last_good(resume_hint=False))

    def _holds_current_weights(self, ckpt: Path) -> bool:
        """Whether checkpoint ``ckpt`` is of this step and holds exactly the model's weights
        (collective in a sharded run: each process compares its shards)."""
        if layout.step_of(ckpt) != self.step:
            return False
        if self.sharded:
            return sharded_io.holds_weights(self.env, ckpt, self.model)
        try:
            saved = upgrade_legacy_keys(self.model, ckpt_read.load_checkpoint(ckpt).model_state)
        except MoeifyError:
            return False
        now = self.model.state_dict()
        return saved.keys() == now.keys() and all(
            torch.equal(saved[k], v.detach().cpu()) for k, v in now.items())

    def _last_good(self, resume_hint: bool = True) -> str:
        if self.last_checkpoint is None:
            return "No good checkpoint has been written yet"
        return (f"The last good checkpoint {self.last_checkpoint} is intact"
                + (f"; continue from it with: moeify train --resume {self.run_dir}"
                   if resume_hint else ""))

    # ------------------------------------------------------------------ training

    def _micro_batches(self, window_BT: torch.Tensor):
        for a in range(self.cfg.grad_accum):
            rows = slice(a * self.micro, (a + 1) * self.micro)
            mem = None if self.memory is None else [m[rows] for m in self.memory]
            yield a, window_BT[rows], mem

    def train_step(self) -> dict[str, Any]:
        """One update; returns the global LM loss and the last micro-batch's aux/stats."""
        cfg = self.cfg
        if self.batcher.starts_new_pass:
            self.memory = None  # the streams restart: the old memory is not their past
        window_BT = self.batcher.next().to(self.device, non_blocking=True)
        self.train_model.train()
        sums_2 = torch.zeros(2, device=self.device, dtype=torch.float32)
        new_memory: list[list[torch.Tensor]] = []
        out = None
        self.balancing.start_step()
        for a, w_bT, mem in self._micro_batches(window_BT):
            with parallel.gradient_sync(self.train_model, a == cfg.grad_accum - 1):
                with autocast_context(self.device, self.amp_dtype):
                    out = self.train_model(w_bT[:, :-1], w_bT[:, 1:], memory=mem,
                                           return_logits=False)
                self.balancing.after_forward(out)
                total = (out.loss + out.aux_loss) / cfg.grad_accum
                self.scaler.scale(total).backward()
            sums_2 += torch.stack([out.loss.detach().float(), out.aux_loss.detach().float()])
            if out.memory is not None:
                new_memory.append(out.memory)
        if self.ep is not None:
            self.ep.sync_grads()  # DDP averaged the rest; the expert shards are ours to reduce
        if new_memory:
            self.memory = [torch.cat(parts, 0) for parts in zip(*new_memory)]
        losses_2 = self.env.all_reduce_mean_(sums_2 / cfg.grad_accum)
        loss, aux = (float(v) for v in losses_2.tolist())
        if not (math.isfinite(loss) and math.isfinite(aux)):
            self.optimizer.zero_grad(set_to_none=True)
            self._diverged(f"the training loss became {'nan' if loss != loss else loss} (aux "
                           f"{aux}) at step {self.step + 1}; the run stopped before updating the "
                           "weights")
        self.scaler.unscale_(self.optimizer)
        params = self.model.parameters()
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        if self.ep is not None:
            grad_norm = self.ep.clip_grad_norm_(params, max_norm)
        else:
            grad_norm = parallel.full_value(torch.nn.utils.clip_grad_norm_(params, max_norm))
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this update uses (logged as such)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        load = self.balancing.after_optimizer_step()  # loss-free bias updates, once per step
        self.scheduler.step()
        self.step += 1
        self.tokens_seen += cfg.batch_size * self.T
        return {"loss": loss, "aux_loss": aux, "lr": lr, "grad_norm": grad_norm,
                "losses": out.losses, "stats": out.stats, "load": load}

    def validate(self) -> dict[str, float]:
        return evaluate_stream(self.model, self.valid_tokens, self.tokenizer, seq_len=self.T,
                               batch_size=self.cfg.eval_batch_size,
                               max_tokens=self.cfg.eval_tokens, device=self.device,
                               amp_dtype=self.amp_dtype)

    def _score_name(self, loss: float) -> tuple[str, float]:
        if self.tokenizer.byte_level:
            return "bpc", loss / math.log(2)
        return "ppl", math.exp(min(loss, 50.0))

    def fit(self, stop_after: int | None = None) -> TrainResult:
        """Train until ``cfg.steps`` (or, to simulate an interruption, ``stop_after``).

        A SIGINT or SIGTERM ends the run after the step in progress, with a checkpoint of it
        (moeify.train.signals); ``result.interrupted`` then names the signal."""
        cfg = self.cfg
        result = TrainResult(run_dir=self.run_dir, step=self.step, rank=self.env.rank)
        sink = MetricsSink(self.run_dir, tensorboard=cfg.tensorboard) if self.env.is_main else None
        progress = Progress(cfg.steps, self.step, stream=self.stream, enabled=not self.quiet)
        clock = _Clock(self.tokens_seen)
        stop = StopRequests(on_first=lambda name: self._say(progress,
            f"{name} received: finishing step {self.step + 1} and writing a checkpoint "
            "(press Ctrl-C again to stop at once)"))
        try:
            if not self.quiet:
                progress.message(self.describe())
            if self.schedule_note:
                self._say(progress, self.schedule_note)
            if cfg.tensorboard and not self.quiet:
                tb = self.run_dir / "tensorboard"
                progress.message(f"TensorBoard logs go to {tb} (view them with: tensorboard "
                                 f"--logdir {tb})")
            with stop:
                while self.step < cfg.steps and (stop_after is None or self.step < stop_after):
                    if self._stop_agreed(stop):
                        self._stop_on_signal(stop, result, progress)
                        break
                    self._one_step(result, sink, progress, clock)
        except KeyboardInterrupt:  # a second signal (or Ctrl-C with no handler installed)
            self._say(progress, f"stopped at once after step {self.step}; nothing "
                      f"half-written was kept. {self._last_good()}")
            raise
        finally:
            progress.close()
            if sink is not None:
                sink.close()
        result.step = self.step
        result.wall_s = time.perf_counter() - clock.start
        n_trained = len(result.losses) * cfg.batch_size * self.T - clock.skipped_tokens
        result.tokens_per_s = n_trained / max(clock.train_s, 1e-9) if clock.train_s else 0.0
        return result

    def _one_step(self, result: TrainResult, sink: MetricsSink | None, progress: Progress,
                  clock: "_Clock") -> None:
        """One update, then the metrics, validation and checkpoint that fall due after it."""
        cfg = self.cfg
        compiling = cfg.compile and not getattr(self, "_compiled", False)
        if compiling:
            progress.message("compiling the model's blocks (torch.compile): the first step "
                             "takes longer, minutes on a CPU; the ETA and tokens/s leave it out")
            t0 = time.perf_counter()
        rec = self.train_step()
        if compiling:
            self._compiled = True
            progress.message(f"compiled: the first step took "
                             f"{format_duration(time.perf_counter() - t0)}")
            progress.restart(self.step)
            clock.skipped_tokens += cfg.batch_size * self.T
            clock.resume(self.tokens_seen)
        result.losses[self.step] = rec["loss"]
        clock.window.append(rec["loss"])
        done = self.step == cfg.steps
        if self.step % cfg.log_every == 0 or done:
            self._log_train(rec, sink, progress, clock, force=done)
        if (cfg.eval_every and self.step % cfg.eval_every == 0) or done:
            clock.pause()
            # A sharded or expert-parallel forward is collective.
            if self.env.is_main or self.sharded:
                result.valid = self._log_validation(sink, progress)
            valid_loss = self.env.broadcast_object(result.valid and result.valid["loss"])
            if valid_loss is not None and not math.isfinite(valid_loss):
                self._diverged(f"the validation loss became {valid_loss} at step {self.step}")
            clock.resume(self.tokens_seen)
        if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or done:
            clock.pause()
            result.checkpoint = self.save_checkpoint()
            clock.resume(self.tokens_seen)

    def _log_train(self, rec: dict[str, Any], sink: MetricsSink | None, progress: Progress,
                   clock: "_Clock", force: bool) -> None:
        now = time.perf_counter()
        clock.train_s += now - clock.mark
        tps = (self.tokens_seen - clock.tokens) / max(now - clock.mark, 1e-9)
        mean_loss = sum(clock.window) / len(clock.window)
        name, score = self._score_name(mean_loss)
        if sink is not None:
            record = {"kind": "train", "step": self.step, "tokens": self.tokens_seen,
                      "loss": mean_loss, name: score, "lr": rec["lr"],
                      "tokens_per_s": tps, "grad_norm": float(rec["grad_norm"]),
                      "aux_loss": rec["aux_loss"]}
            record.update({f"aux/{k}": float(v.detach()) for k, v in rec["losses"].items()})
            record.update({f"stats/{k}": summarise_tensor(v) for k, v in rec["stats"].items()})
            for k, c in rec.get("load", {}).items():
                # Per-expert load of the update, all micro-batches and processes: the counts and
                # max / mean (1 = perfectly balanced).
                record[f"load/{k}"] = summarise_tensor(c)  # the counts (up to 64 experts)
                record[f"load_spread/{k}"] = float(c.max() / c.mean().clamp_min(1e-9))
            sink.write(record)
        progress.update(self.step, {"loss": mean_loss, name: score, "lr": rec["lr"]}, tps,
                        force=force)
        clock.window = []
        clock.resume(self.tokens_seen)

    def _say(self, progress: Progress, text: str) -> None:
        """A message that --quiet does not silence (on process 0)."""
        if progress.enabled:
            progress.message(text)
        elif self.env.is_main:
            print(text, file=self.stream, flush=True)

    def _stop_agreed(self, stop: StopRequests) -> bool:
        """Whether any process received a stop signal (all of them then stop at this step)."""
        if not self.env.enabled:
            return stop.requested is not None
        flag = torch.tensor([1.0 if stop.requested else 0.0], device=self.device)
        return bool(self.env.all_reduce_mean_(flag).item() > 0)

    def _stop_on_signal(self, stop: StopRequests, result: TrainResult,
                        progress: Progress) -> None:
        """Checkpoint the step just finished (unless it already is) and say how to resume.
        A second signal while writing stops at once; the write is atomic."""
        last = self.last_checkpoint
        saved = last is not None and layout.step_of(last) == self.step
        if self.step > 0 and not saved:
            result.checkpoint = self.save_checkpoint()
        result.interrupted = stop.requested or "SIGINT"
        result.exit_code = stop.exit_code
        where = (f"checkpoint {self.last_checkpoint} holds step {self.step}"
                 if self.last_checkpoint else "no step had finished, nothing was saved")
        self._say(progress, f"stopped by {result.interrupted} after step {self.step} of "
                         f"{self.cfg.steps}: {where}; resume with: moeify train --resume "
                         f"{self.run_dir}")

    def _log_validation(self, sink: MetricsSink | None, progress: Progress) -> dict[str, float]:
        t0 = time.perf_counter()
        res = self.validate()
        name = "bpc" if "bpc" in res else "ppl"
        if sink is not None:
            sink.write({"kind": "valid", "step": self.step, "tokens": res["tokens"],
                        "loss": res["loss"], name: res[name],
                        "seconds": time.perf_counter() - t0})
        progress.message(f"validation at step {self.step}: loss {res['loss']:.4f}, {name} "
                         f"{res[name]:.4f} ({res['tokens']} tokens)")
        return res

    def describe(self) -> str:
        n_params = sum(p.numel() for p in self.model.parameters())  # DTensors: global numel
        return (f"training {self.cfg.preset} ({n_params / 1e6:.2f}M parameters) on "
                f"{self.corpus.name} with the {self.tokenizer.name} tokenizer (vocab "
                f"{self.tokenizer.vocab_size}): {self.cfg.steps} steps x {self.cfg.batch_size} x "
                f"{self.T} tokens, {self.env.world_size} process(es) on {self.device}"
                + (f" ({torch.get_num_threads()} threads), " if self.device.type == "cpu"
                   else ", ") +
                f"run directory {self.run_dir}")

    def close(self) -> None:
        self.lock.release()
        self.env.close()


def _remove_if_empty(path: Path) -> bool:
    try:
        path.rmdir()  # only an empty directory
        return True
    except OSError:
        return False


def train(cfg: TrainConfig, run_dir: str | Path, *, resume: bool | str | Path = False,
          stop_after: int | None = None, quiet: bool = False,
          stream: TextIO | None = None, schedule: str | None = None) -> TrainResult:
    """Train ``cfg`` into ``run_dir`` (resuming its latest checkpoint, or the checkpoint
    ``resume`` names, when ``resume`` is given; ``schedule``: keep, extend or stretch, what the
    learning-rate schedule does when a resume changes ``steps``)."""
    with quiet_progress(quiet):  # the corpus and tokeniser lines too
        trainer = Trainer(cfg, run_dir, resume=resume, quiet=quiet, stream=stream,
                          schedule=schedule)
        try:
            return trainer.fit(stop_after)
        finally:
            trainer.close()


def _is_peer_error(e: BaseException) -> bool:
    """An error of the process group's transport (a peer that is gone), raised by a collective
    inside torch (FSDP's get_state_dict) rather than by DistEnv's helpers."""
    backend_error = getattr(dist, "DistBackendError", ())
    text = str(e)
    return (backend_error and isinstance(e, backend_error)) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "gloo"))


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
        state = model.state_dict()
        if trainer.ep is not None:  # this process's rows of the experts, as Shard(0) DTensors
            state = trainer.ep.load_full_state(state, None, None)[0]
        trainer.model.load_state_dict(state, strict=True)
        valid = None
        # A sharded or expert-parallel forward is collective: every process validates then.
        if validate and (trainer.env.is_main or trainer.sharded):
            sink = (MetricsSink(trainer.run_dir, tensorboard=False) if trainer.env.is_main
                    else None)
            try:
                valid = trainer._log_validation(sink, Progress(cfg.steps, 0, stream=trainer.stream,
                                                               enabled=not trainer.quiet))
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
    return dataclasses.replace(base, model=model.to_dict(), model_overrides=(),
                               cosine_steps=None, lr_extensions=(),
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
    with quiet_progress(quiet):
        start_run_from_model(cfg, run_dir, model, src.tokenizer, validate=False, quiet=True,
                             stream=stream)
    return train(cfg, run_dir, resume=True, quiet=quiet, stream=stream)
