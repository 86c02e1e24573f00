"""Parallelism as a plan: how one run spreads over its processes, applied to a model from outside
(the model code is written for one device; layers never touch torch.distributed). The trainer
holds one plan and calls only its narrow interface, so a new parallelism is a new plan:

    wrap(model)             compile and/or shard in place, or wrap (DDP): the module to train
    gradient_sync(sync)     a context for one micro-batch's backward (reduce only when ``sync``)
    after_backward()        after the update's last backward (expert parallelism's reduction)
    clip_grad_norm_(...)    the global gradient norm, clipped
    optimizer_options()     keyword arguments for the optimizer
    load_full_state(...)    full (single-file) weights and optimizer state into this layout
    save(...) / restore()   write / read this layout's checkpoint (single-file or sharded)

The plans:

    SingleProcess   one process, nothing wrapped (``compile=True``: every block compiled).
    DataParallel    DistributedDataParallel: every process holds the whole model, gradients are
                    all-reduced (averaged) after backward. Single-file checkpoints.
    FullyShard      FSDP2 (``torch.distributed.fsdp.fully_shard``) on every block and then on
                    the whole model (embedding, final norm, output layer): parameters, gradients
                    and AdamW state are sharded over the processes (dim 0 of every parameter, so
                    no parameter is 0-dim: moeify.layers.common); a block's parameters are
                    all-gathered around its forward and backward, gradients reduce-scattered
                    (averaged). Also in one process. Sharded (DCP) checkpoints.
    ExpertParallel  the expert weights of every MoE feedforward Shard(0) over an "ep" mesh
                    dimension (moeify.train.expert_parallel), the rest under DataParallel or
                    FullyShard (which leave the expert shards alone). Sharded checkpoints.

``compile=True`` compiles every block in place (``nn.Module.compile``: state-dict keys do not
change, so checkpoints are the same with and without it), before sharding, as torchtitan does.
Routing-usage buffers (``usage*``, int64, not persistent) are left alone by every plan: DDP is
built without buffer broadcasting and FSDP2 shards parameters only, so each process counts the
routing of its own tokens.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any

import torch

from moeify.errors import MoeifyError
from moeify.rundir import sharded as sharded_io
from moeify.rundir import write as ckpt_io
from moeify.rundir.checkpoints import NonFiniteState, load_checkpoint, load_model_state
from moeify.train.config import PARALLEL_MODES
from moeify.train.distributed import DistEnv, exit_at


class CheckpointNotWritten(MoeifyError):
    """A checkpoint write failed (a full disk, non-finite values); raised on every process, the
    previous checkpoint intact and still the latest."""


def allow_data_dependent_shapes() -> None:
    """Let dynamo trace expert parallelism's dispatch (moeify.train.expert_parallel) into one
    graph: the token counts the all-to-all exchanges become unbacked symbolic sizes
    (``capture_scalar_outputs``: the splits read with ``tolist``) and the routed pairs come from
    ``nonzero`` (``capture_dynamic_output_shape_ops``). Without them every MoE layer's forward
    breaks into pieces at those points. Process-wide dynamo settings, set when expert-parallel
    blocks are compiled."""
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.capture_dynamic_output_shape_ops = True


def compile_blocks(model: torch.nn.Module, *, expert_parallel: bool = False) -> torch.nn.Module:
    """Compile every block of a TransformerLM in place (module docstring); returns ``model``."""
    if expert_parallel:
        allow_data_dependent_shapes()
    for block in model.blocks:
        block.compile()
    return model


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly sharded one (clip_grad_norm_'s total norm under FSDP is a
    DTensor): collective there, so every process must call it."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class SingleProcess:
    """One process: nothing wrapped, single-file checkpoints (module docstring)."""

    name = "single process"
    sharded = False  # sharded (DCP) checkpoints, and a forward that is collective

    def __init__(self, env: DistEnv, device: torch.device, *, compile: bool = False) -> None:
        self.env, self.device, self.compile = env, device, compile

    def wrap(self, model: torch.nn.Module, ignored=()) -> torch.nn.Module:
        """The module to train. ``ignored``: parameters another plan reduces itself."""
        if self.compile:
            compile_blocks(model, expert_parallel=bool(ignored))
        return model

    def gradient_sync(self, train_model: torch.nn.Module, sync: bool):
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        pass

    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        return full_value(torch.nn.utils.clip_grad_norm_(list(params), max_norm))

    def optimizer_options(self) -> dict[str, Any]:
        return {}

    def load_full_state(self, model: torch.nn.Module, ckpt, optimizer_state: dict | None,
                        optimizer: torch.optim.Optimizer) -> dict | None:
        """Load a single-file checkpoint's full weights into ``model``; returns the optimizer
        state to load (full tensors, this layout's)."""
        load_model_state(model, ckpt)
        return optimizer_state

    # ------------------------------------------------------------------ checkpoints

    def save(self, run_dir: Path, step: int, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, state: dict | None, *, meta: dict[str, Any],
             keep: int) -> Path | None:
        """Collective: process 0 writes a single-file checkpoint (``state``: the unsharded
        training state, process 0's). Raises CheckpointNotWritten on every process."""
        error, path = None, None
        if self.env.is_main:
            state["optimizer"] = optimizer.state_dict()
            try:
                path = ckpt_io.save_checkpoint(run_dir, step, model.state_dict(), state,
                                               meta=meta, keep=keep)
            except NonFiniteState as e:
                error = str(e)
            except OSError as e:
                error = ckpt_io.write_failure(step, e)
        else:
            exit_at(f"checkpoint-{step}", self.env.rank)  # tests: a process dies here
        error = self.env.broadcast_object(error)
        if error is not None:
            raise CheckpointNotWritten(error)
        return path

    def restore(self, ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                model_config: dict) -> tuple[dict, Any]:
        """(the training state, the Checkpoint or None) of a checkpoint of either kind, weights
        and optimizer state loaded. A sharded checkpoint loads into any layout (DCP stores
        global shapes and offsets); collective when the model is sharded."""
        from moeify.rundir.checkpoints import is_sharded_checkpoint, reshape_scalar_state

        if is_sharded_checkpoint(ckpt):
            return sharded_io.restore_sharded(ckpt, model, optimizer,
                                              model_config=model_config), None
        loaded = load_checkpoint(ckpt, map_location="cpu", model_config=model_config)
        st = dict(loaded.train_state)
        opt = st.get("optimizer")
        if opt is not None:
            reshape_scalar_state(opt, [p for g in optimizer.param_groups for p in g["params"]])
        opt = self.load_full_state(model, loaded, opt, optimizer)
        if opt is not None:
            st["optimizer"] = opt
        return st, loaded

    def holds_weights(self, ckpt: Path, model: torch.nn.Module) -> bool:
        """Whether checkpoint ``ckpt`` holds exactly ``model``'s weights (collective when
        sharded; otherwise process 0's answer)."""
        from moeify.layers.common import upgrade_legacy_keys

        try:
            saved = upgrade_legacy_keys(model, load_checkpoint(ckpt).model_state)
        except MoeifyError:
            return False
        now = model.state_dict()
        return saved.keys() == now.keys() and all(
            torch.equal(saved[k], v.detach().cpu()) for k, v in now.items())


class DataParallel(SingleProcess):
    """DistributedDataParallel (module docstring)."""

    name = "DDP"

    def wrap(self, model: torch.nn.Module, ignored=()) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        super().wrap(model, ignored)
        if ignored:
            names = {id(p): n for n, p in model.named_parameters()}
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, [names[id(p)] for p in ignored])
        # Buffers are routing-usage counters local to each process: never sync them in forward
        # (the argument was renamed in recent torch; at init they are all zeros either way).
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in params
                   else {"broadcast_buffers": False})
        return DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            **no_sync)

    def gradient_sync(self, train_model: torch.nn.Module, sync: bool):
        return contextlib.nullcontext() if sync else train_model.no_sync()


class FullyShard(SingleProcess):
    """FSDP2 on every block, then the root (module docstring). Parameters stay float32
    (autocast computes the matmuls in bf16 or fp16), so gradients are reduced in float32."""

    name = "FSDP2"
    sharded = True

    def wrap(self, model: torch.nn.Module, ignored=()) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        super().wrap(model, ignored)
        ignored = set(ignored) or None
        for block in model.blocks:
            fully_shard(block, ignored_params=ignored)
        fully_shard(model, ignored_params=ignored)
        return model

    @contextlib.contextmanager
    def gradient_sync(self, train_model: torch.nn.Module, sync: bool):
        train_model.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            train_model.set_requires_gradient_sync(True)

    def load_full_state(self, model, ckpt, optimizer_state, optimizer):
        """Full weights into the shards (every process reads the same file); an optimizer state
        of full tensors is refused: resume such a checkpoint with parallel=ddp."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_model_state_dict)

        if optimizer_state is not None:
            raise MoeifyError(f"{ckpt.path} is a single-file checkpoint with an optimizer state; "
                              "resume it with --set parallel=ddp (a sharded run resumes "
                              "sharded checkpoints), or start a new run from its weights with "
                              "--init-from")
        from moeify.layers.common import upgrade_legacy_keys

        state = upgrade_legacy_keys(model, dict(ckpt.model_state))
        for k, v in list(state.items()):  # 0-dim scalars of an earlier layout (layers.common)
            if v.dim() == 0 and k.endswith((".scale", ".bias_router")):
                state[k] = v.reshape(1)
        try:
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
        except (RuntimeError, KeyError, ValueError) as e:
            first = str(e).strip().splitlines()
            raise MoeifyError(f"checkpoint {ckpt.path} does not fit this model: "
                              f"{' '.join(first[:2])}") from None
        return None

    def save(self, run_dir, step, model, optimizer, state, *, meta, keep):
        """Collective: every process writes its shards (moeify.rundir.sharded)."""
        try:
            return sharded_io.save_sharded(self.env, run_dir, step, model, optimizer, state,
                                           meta={**meta, "world_size": self.env.world_size,
                                                 "expert_parallel": getattr(self, "degree", 1)},
                                           keep=keep)
        except NonFiniteState as e:  # raised on every process
            raise CheckpointNotWritten(str(e)) from None
        except sharded_io.ShardedWriteFailed as e:
            raise CheckpointNotWritten(ckpt_io.write_failure(step, e) or str(e)) from None

    def holds_weights(self, ckpt, model) -> bool:
        return sharded_io.holds_weights(self.env, ckpt, model)


class ExpertParallel(FullyShard):
    """Expert parallelism over an "ep" mesh dimension, the other parameters under the plan
    ``data`` (DataParallel or FullyShard); sharded checkpoints either way."""

    sharded = True

    def __init__(self, env: DistEnv, device: torch.device, *, degree: int,
                 data: SingleProcess) -> None:
        super().__init__(env, device, compile=data.compile)
        self.degree, self.data = degree, data
        self.name = f"expert parallel {degree} x {data.name}"
        self.ep = None

    def wrap(self, model: torch.nn.Module, ignored=()) -> torch.nn.Module:
        from moeify.train.expert_parallel import ExpertParallel as Experts

        # The expert weights become Shard(0) DTensors over the "ep" mesh dimension before DDP
        # or FSDP (which must leave them alone) and before the optimizer (which must see them).
        self.ep = Experts(model, self.degree, self.device)
        return self.data.wrap(model, ignored=list(self.ep.params.values()))

    def gradient_sync(self, train_model, sync):
        return self.data.gradient_sync(train_model, sync)

    def after_backward(self) -> None:
        self.ep.sync_grads()  # DDP or FSDP averaged the rest; the expert shards are ours

    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        return self.ep.clip_grad_norm_(params, max_norm)

    def optimizer_options(self) -> dict[str, Any]:
        # torch's foreach kernels (its default on GPUs) refuse a list that mixes plain tensors
        # with DTensors, or DTensors of two meshes, as expert parallelism's groups do
        return {"foreach": False}

    def load_full_state(self, model, ckpt, optimizer_state, optimizer):
        """Full experts on disk: this process keeps its rows of the weights and AdamW state."""
        model_state, optimizer_state = self.ep.load_full_state(
            dict(ckpt.model_state), optimizer_state, optimizer)
        load_model_state(model, _with_state(ckpt, model_state))
        return optimizer_state


def _with_state(ckpt, model_state):
    import dataclasses

    return dataclasses.replace(ckpt, model_state=model_state)


def make_plan(parallel: str, expert_parallel: int, env: DistEnv, device: torch.device, *,
              compile: bool = False, origin: str = "as requested") -> SingleProcess:
    """The plan of a run's settings: ``parallel`` (ddp, fsdp) and ``expert_parallel`` P over the
    processes of ``env``. With one process and ``parallel=ddp`` nothing is wrapped;
    ``parallel=fsdp`` always shards (a one-process FSDP run equals the unsharded run).
    ``origin``: where the settings come from, for the refusal of a P that does not fit."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL_MODES)}, got {parallel!r}")
    W, P = env.world_size, expert_parallel
    if P < 1 or W % P:
        divisors = [d for d in range(1, W + 1) if W % d == 0]
        raise ValueError(
            f"expert_parallel={P} ({origin}) must divide the number of processes ({W}): start a "
            f"multiple of {P} processes (torchrun --nproc-per-node {max(P, 1)} -m "
            f"moeify.cli.main train ...), or change it with --set expert_parallel=N for N in "
            f"{', '.join(map(str, divisors))} (a sharded checkpoint resumes at any degree)")
    if parallel == "fsdp":
        data: SingleProcess = FullyShard(env, device, compile=compile)
    elif env.enabled:
        data = DataParallel(env, device, compile=compile)
    else:
        data = SingleProcess(env, device, compile=compile)
    if expert_parallel > 1:
        return ExpertParallel(env, device, degree=expert_parallel, data=data)
    return data
