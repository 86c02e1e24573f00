"""The training loop (SwitchHead appendix): AdamW, warm-up + cosine, clipping, accumulation,
autocast, XL memory across steps, validation, atomic checkpoints, exact resume, data parallel.

Shape legend: B rows of this process per update, b rows per micro-batch (B / grad_accum),
T tokens per row (the model's context length), D d_model, L layers, W processes.

One update: the process's [B, T+1] window is cut into grad_accum micro-batches of b rows; each
runs forward with its rows of the XL memory (the previous window's block inputs, detached) and
backward with loss / grad_accum (the model's aux losses, already weighted, are added); then the
gradients are averaged over processes (the run's plan: DDP, FSDP2, expert parallelism;
moeify.train.plans), clipped to norm kappa, and AdamW steps. Every micro-batch has the same
number of tokens, so this equals one big batch: W processes with B rows each compute the update
of one process with W*B rows (tests/train/test_distributed.py).

Micro-batch a takes rows a, a + grad_accum, ... of the window (every grad_accum-th row). Process
r holds streams r*B .. r*B + B-1 and grad_accum divides B, so micro-batch a of all processes is
the streams congruent to a modulo grad_accum, whatever W: what is taken over the global
micro-batch (the global-batch balance loss's counts so far, moeify.train.balancing) is one
process's (blocks of consecutive rows would give micro-batch 0 the streams {0, B} of two
processes but {0, 1} of one).

Exactness of resume: the checkpoint holds everything the next update reads (weights, AdamW
moments, schedule position, grad-scaler state, data position, every process's RNG state and the
XL memory of every row), so a resumed run repeats the uninterrupted run's losses bit for bit on
the same hardware and process count.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from moeify.data.cache import quiet_progress
from moeify.data.stream import StreamBatcher, tokenize_split
from moeify.errors import MoeifyError
from moeify.ops.optim import adamw
from moeify.rundir import layout
from moeify.rundir.atomic import write_json_atomic
from moeify.rundir.files import model_config_dict, read_model_config, write_run_files
from moeify.rundir.layout import CONFIG_FILE
from moeify.rundir import write as ckpt_io
from moeify.rundir.lock import RunLock, lock_run_dir
from moeify.train.config import TrainConfig, resolve_model_config
from moeify.train.activation_checkpointing import apply_activation_checkpointing
from moeify.train.balancing import Balancing
from moeify.train.distributed import (DistEnv, collective_failure, device_type, pick_device,
                                      exit_at, resume_command, setup_distributed)
from moeify.train.plans import CheckpointNotWritten, make_plan
from moeify.train.run_state import apply_state, gather_state
from moeify.train.metrics import MetricsSink, truncate_metrics
from moeify.train.reporting import Clock, TrainResult, log_train, log_validation
from moeify.train.progress import Progress, format_duration
from moeify.train.resume import check_run_dir, corpus_and_tokenizer
from moeify.train.schedule import make_scheduler, resume_schedule, schedule_factor
from moeify.train.signals import StopRequests
from moeify.train.validate import autocast_context, evaluate_stream, resolve_amp


class NonFiniteLoss(MoeifyError):
    """The loss became NaN or infinite; the run stopped before updating the weights."""


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
        self._given_tokenizer = tokenizer
        self.run_dir = Path(run_dir)
        self.stream = stream if stream is not None else sys.stderr
        self.env: DistEnv = setup_distributed(device_type(cfg.device),
                                              single=cfg.parallel == "fsdp")
        self.lock = RunLock(self.run_dir)
        # A refused start leaves no directory behind that it created (moeify train on an
        # unusable device, a bad setting found late, ...), parents such as runs/ included.
        created = [p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]
        try:
            # Before the run directory is touched: a device this machine lacks is a refusal.
            self.device = pick_device(cfg.device, self.env)
            error = lock_run_dir(self.lock) if self.env.is_main else None
            error = self.env.broadcast_object(error)
            if error is not None:
                raise MoeifyError(error)
            self._setup(resume, quiet)
        except BaseException:
            self.close()  # a process group or lock this run took must not outlive it
            if self.env.is_main:
                for path in created:  # innermost first; stops at the first one not empty
                    if not _remove_if_empty(path):
                        break
            raise

    def _setup(self, resume: bool | str | Path, quiet: bool) -> None:
        """Everything before the first step, in an order that matters: the run directory is
        checked (and a resume settles the schedule) before the data and the model are made;
        the seeds are set around building the model; expert parallelism and DDP/FSDP wrap the
        model before the optimizer sees its parameters; the run's files are written last."""
        self.quiet = quiet or not self.env.is_main
        self.amp_dtype, use_scaler = resolve_amp(self.cfg.amp, self.device)
        self._split_batch()
        point = check_run_dir(self.run_dir, self.cfg, resume, self.schedule_choice)
        # A resume may have settled the schedule.
        self.cfg, self.schedule_note, self.weights_only = point.cfg, point.schedule_note, \
            point.weights_only
        cfg, ckpt_dir = self.cfg, point.checkpoint
        self.corpus, self.tokenizer = corpus_and_tokenizer(
            self.cfg, self.env, self.run_dir if ckpt_dir is not None else None,
            self._given_tokenizer)
        self._resolve_model(cfg, resumed=ckpt_dir is not None)
        recorded = point.recorded is not None and \
            point.recorded.expert_parallel == cfg.expert_parallel
        self._build_model(cfg, origin=f"the run's recorded setting, in {self.run_dir}/config.json"
                          if recorded else "as requested")
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

    def _build_model(self, cfg: TrainConfig, origin: str = "as requested") -> None:
        """The model on the device (``self.model``), the run's parallelism plan (``self.plan``:
        moeify.train.plans) and the module the steps run (``self.train_model``: compiled,
        sharded or DDP-wrapped, before the optimizer, which must see the sharded parameters)."""
        torch.manual_seed(cfg.seed)  # identical initial weights in every process
        self.model = self.model_cfg.build().to(self.device)
        torch.manual_seed(cfg.seed + 1 + self.env.rank)  # per-process dropout randomness
        self.plan = make_plan(cfg.parallel, cfg.expert_parallel, self.env, self.device,
                              compile=cfg.compile, origin=origin)
        apply_activation_checkpointing(self.model, cfg.activation_checkpointing)  # in place
        self.train_model: torch.nn.Module = self.plan.wrap(self.model)
        # Sharded (DCP) checkpoints, and a forward that is collective: FSDP or EP.
        self.sharded = self.plan.sharded
        self.balancing = Balancing(self.model, self.env)

    def _build_optimizer(self, cfg: TrainConfig, use_scaler: bool) -> None:
        """AdamW (no weight decay on vectors), the learning-rate schedule, the grad scaler."""
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = adamw(  # fused where torch can (moeify.ops.optim)
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas,
            **self.plan.optimizer_options())
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=use_scaler)

    def _load_tokens(self) -> None:
        """The tokenised splits (process 0 fills the cache first) and the training batcher."""
        self.train_tokens = self.env.rank0_first(lambda: tokenize_split(self.corpus, self.tokenizer,
                                                                     "train"))
        self.valid_tokens = self.env.rank0_first(lambda: tokenize_split(self.corpus, self.tokenizer,
                                                                     "valid"))
        self.batcher = StreamBatcher(self.train_tokens, self.rows, self.T,
                                     rank=self.env.rank, world_size=self.env.world_size)

    # ------------------------------------------------------------------ checkpoints

    def _restore(self, ckpt_dir: Path) -> None:
        st, loaded = self.plan.restore(ckpt_dir, self.model, self.optimizer,
                                       model_config_dict(self.model_cfg))
        if self.weights_only:
            # Weights without a training state (moeify import): training starts at step 0 with
            # a fresh optimizer and data position, under the settings of this invocation.
            self.last_checkpoint = ckpt_dir
            if self.env.is_main:
                write_json_atomic(self.run_dir / CONFIG_FILE, self.cfg.to_dict())
                truncate_metrics(self.run_dir, 0)
            return
        try:
            apply_state(self, st, schedule_factor(self.cfg, int(st["step"])))
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            raise MoeifyError(f"checkpoint {ckpt_dir} has an unusable training state ({e}); "
                              "use an earlier checkpoint") from None
        self.last_checkpoint = ckpt_dir
        if self.env.is_main:
            truncate_metrics(self.run_dir, self.step)

    def save_checkpoint(self) -> Path | None:
        """Collective: every process contributes its RNG state and XL memory rows (and, in a
        sharded run, writes its shards). A process that dies meanwhile makes the others stop
        with one line (collective_failure); the previous checkpoint stays intact."""
        kind = "sharded checkpoint" if self.sharded else "checkpoint"
        with self._collectives(f"the {kind} of step {self.step}"):
            meta = {"preset": self.cfg.preset, "model_config": model_config_dict(self.model_cfg),
                    "train_config": self.cfg.to_dict()}
            try:
                self.last_checkpoint = self.plan.save(
                    self.run_dir, self.step, self.model, self.optimizer, gather_state(self),
                    meta=meta, keep=self.cfg.keep_checkpoints)
            except CheckpointNotWritten as e:  # raised on every process
                raise MoeifyError(f"{e}. {self._last_good()}") from None
        return self.last_checkpoint

    @contextlib.contextmanager
    def _collectives(self, during: str):
        """Collectives that fail because another process died or hung (a transport error, a
        timeout) end in one line naming this process, what it was doing and the latest
        complete checkpoint on disk (moeify.train.distributed.collective_failure)."""
        try:
            yield
        except RuntimeError as e:
            message = collective_failure(e, self.env, during, self.run_dir)
            if message is None:
                raise
            raise MoeifyError(message) from None

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
        return self.plan.holds_weights(ckpt, self.model)

    def _last_good(self, resume_hint: bool = True) -> str:
        if self.last_checkpoint is None:
            return "No good checkpoint has been written yet"
        return (f"The last good checkpoint {self.last_checkpoint} is intact"
                + (f"; continue from it with: "
                   f"{resume_command(self.run_dir, self.env.world_size)}"
                   if resume_hint else ""))

    # ------------------------------------------------------------------ training

    def _micro_batches(self, window_BT: torch.Tensor):
        """(a, rows a, a + grad_accum, ... of the window and of the XL memory) for every
        micro-batch a: the same streams whatever the process count (module docstring)."""
        A = self.cfg.grad_accum
        for a in range(A):
            mem = None if self.memory is None else [m[a::A] for m in self.memory]
            yield a, window_BT[a::A], mem

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
            with self.plan.gradient_sync(self.train_model, a == cfg.grad_accum - 1):
                with autocast_context(self.device, self.amp_dtype):
                    out = self.train_model(w_bT[:, :-1], w_bT[:, 1:], memory=mem,
                                           return_logits=False)
                aux_loss = self.balancing.after_forward(out)  # global-batch losses retaken
                total = (out.loss + aux_loss) / cfg.grad_accum
                self.scaler.scale(total).backward()
            sums_2 += torch.stack([out.loss.detach().float(), aux_loss.detach().float()])
            if out.memory is not None:
                new_memory.append(out.memory)
        self.plan.after_backward()
        if new_memory:
            # back in window order: row i of micro-batch a is row i * grad_accum + a
            self.memory = [torch.stack(parts, 1).flatten(0, 1) for parts in zip(*new_memory)]
        losses_2 = self.env.all_reduce_mean_(sums_2 / cfg.grad_accum)
        loss, aux = (float(v) for v in losses_2.tolist())
        if not (math.isfinite(loss) and math.isfinite(aux)):
            self.optimizer.zero_grad(set_to_none=True)
            self._diverged(f"the training loss became {'nan' if loss != loss else loss} (aux "
                           f"{aux}) at step {self.step + 1}; the run stopped before updating the "
                           "weights")
        self.scaler.unscale_(self.optimizer)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = self.plan.clip_grad_norm_(self.model.parameters(), max_norm)
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

    def fit(self, stop_after: int | None = None) -> TrainResult:
        """Train until ``cfg.steps`` (or, to simulate an interruption, ``stop_after``).

        A SIGINT or SIGTERM ends the run after the step in progress, with a checkpoint of it
        (moeify.train.signals); ``result.interrupted`` then names the signal."""
        cfg = self.cfg
        result = TrainResult(run_dir=self.run_dir, step=self.step, rank=self.env.rank)
        sink = MetricsSink(self.run_dir, tensorboard=cfg.tensorboard) if self.env.is_main else None
        progress = Progress(cfg.steps, self.step, stream=self.stream, enabled=not self.quiet)
        clock = Clock(self.tokens_seen)
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
                    with self._collectives(f"step {self.step + 1}"):
                        if self._stop_agreed(stop):
                            self._stop_on_signal(stop, result, progress)
                            break
                        self._one_step(result, sink, progress, clock)
                    exit_at(f"step-{self.step}", self.env.rank)  # tests: a process dies here
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
                  clock: Clock) -> None:
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
            log_train(self, rec, sink, progress, clock, force=done)
        if (cfg.eval_every and self.step % cfg.eval_every == 0) or done:
            clock.pause()
            # A sharded or expert-parallel forward is collective.
            if self.env.is_main or self.sharded:
                result.valid = log_validation(self, sink, progress)
            valid_loss = self.env.broadcast_object(result.valid and result.valid["loss"])
            if valid_loss is not None and not math.isfinite(valid_loss):
                self._diverged(f"the validation loss became {valid_loss} at step {self.step}")
            clock.resume(self.tokens_seen)
        if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or done:
            clock.pause()
            result.checkpoint = self.save_checkpoint()
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
                         f"{self.cfg.steps}: {where}; resume with: "
                         f"{resume_command(self.run_dir, self.env.world_size)}")

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
