"""Parallelism and compilation, applied to a model from outside (docs/layout.md: the model code is
written for one device; layers never touch torch.distributed).

    parallel="ddp"   DistributedDataParallel: every process holds the whole model, gradients are
                     all-reduced (averaged) after backward.
    parallel="fsdp"  FSDP2 (``torch.distributed.fsdp.fully_shard``) on every block and then on
                     the whole model (embedding, final norm, output layer): parameters, gradients
                     and AdamW state are sharded over the processes (dim 0 of every parameter);
                     a block's parameters are all-gathered just before its forward and backward
                     and freed after, and gradients are reduce-scattered (averaged).
    compile=True     torch.compile on every block, in place (``nn.Module.compile``: state-dict
                     keys do not change, so checkpoints are the same with and without it),
                     before sharding, as torchtitan does. The embedding and the loss stay eager.

Routing-usage buffers (``usage*``, int64, not persistent) are left alone by both wrappers: DDP is
built without buffer broadcasting and FSDP2 shards parameters only, so each process counts the
routing of its own tokens, in either mode.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from moeify.train.config import PARALLEL_MODES


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


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    # Buffers are routing-usage counters local to each process: never sync them in forward
    # (the argument was renamed in recent torch; at init they are all zeros either way).
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in params
               else {"broadcast_buffers": False})
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, **no_sync)


def shard_fsdp(model: torch.nn.Module, ignored=None) -> torch.nn.Module:
    """FSDP2 in place: ``fully_shard`` per block, then on the root (the embedding and output
    layer), over all processes of the default group. Parameters stay float32 (autocast computes
    the matmuls in bf16 or fp16), so gradients are reduced in float32. ``ignored``: parameters
    FSDP must leave alone (the expert shards of expert parallelism, DTensors of their own mesh
    whose gradients moeify.train.expert_parallel reduces)."""
    from torch.distributed.fsdp import fully_shard

    ignored = set(ignored) if ignored else None
    for block in model.blocks:
        fully_shard(block, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    return model


def parallelize(model: torch.nn.Module, mode: str, *, device: torch.device, distributed: bool,
                compile: bool = False, expert_params=None) -> torch.nn.Module:
    """The module to train: ``model`` compiled and/or sharded in place, or a DDP wrapper around
    it. With one process and ``mode="ddp"`` nothing is wrapped; ``mode="fsdp"`` always shards
    (a one-process FSDP run equals the unsharded run). ``expert_params``: the expert-parallel
    shards (moeify.train.expert_parallel, already applied), which neither DDP nor FSDP
    reduces."""
    if mode not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL_MODES)}, got {mode!r}")
    if compile:
        compile_blocks(model, expert_parallel=bool(expert_params))
    if mode == "fsdp":
        return shard_fsdp(model, ignored=expert_params)
    if distributed and expert_params:
        from torch.nn.parallel import DistributedDataParallel

        names = {id(p): n for n, p in model.named_parameters()}
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [names[id(p)] for p in expert_params])
    return wrap_ddp(model, device) if distributed else model


def gradient_sync(train_model: torch.nn.Module, sync: bool):
    """A context for one micro-batch's backward: gradients are reduced over the processes only
    when ``sync`` (the last micro-batch of an update); earlier ones accumulate locally."""
    if sync:
        return contextlib.nullcontext()
    if hasattr(train_model, "no_sync"):  # DDP
        return train_model.no_sync()
    if hasattr(train_model, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(train_model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly sharded one (clip_grad_norm_'s total norm under FSDP is a
    DTensor): collective there, so every process must call it."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
