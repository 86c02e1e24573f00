"""Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
arXiv 1604.06174): a checkpointed block keeps only its inputs for backward and runs its forward
again there to rebuild the rest, trading one more forward per block for the memory of its
activations. Applied from outside the model, per block, in place, as torchtitan applies it:

    activation_checkpointing="none"   every activation kept (the default)
    activation_checkpointing="block"  every block of the model checkpointed
                                      (torch.utils.checkpoint, non-reentrant)

In place: the block's ``forward`` is replaced, so parameter names, state-dict keys and
checkpoints are the same with and without it. Applied before compilation and sharding (the
trainer's order), it composes with ``compile`` (dynamo traces the checkpointed forward as one
region and recomputes it in the compiled backward), FSDP2 (a block's parameters are gathered
again for its backward, where the recomputation runs) and expert parallelism (the recomputation
repeats the block's all-to-alls, in the same order on every process). The random state is
restored for the recomputation (dropout, expert dropout and hence the routing repeat exactly).

What a block's forward *counts* is not counted twice: the balancing statistics are read from
what the model returns (moeify.train.balancing), and the layers' running usage counters (int64
buffers, moeify.layers.common.register_usage) are put back after an eager recomputation to the
values the forward left.

Shape legend: none (no tensor maths here).
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint as tuc

from moeify.train.config import AC_MODES as MODES


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Checkpoint every block of a TransformerLM in place (``mode="block"``); returns ``model``.
    ``mode="none"`` changes nothing."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing must be one of {', '.join(MODES)}, got "
                         f"{mode!r}")
    if mode == "block":
        for block in model.blocks:
            checkpoint_module(block)
    return model


def checkpoint_module(module: torch.nn.Module) -> None:
    """Replace ``module.forward`` by its checkpointed form (module docstring)."""
    forward = module.forward

    def recompute_context():
        return contextlib.nullcontext(), _counters_kept(module)

    def checkpointed(*args, **kwargs):
        if torch.compiler.is_compiling():
            # Compiled, the recomputation is the backward graph's and replays no buffer update.
            return tuc.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return tuc.checkpoint(forward, *args, use_reentrant=False,
                              context_fn=recompute_context, **kwargs)

    module.forward = checkpointed


@contextlib.contextmanager
def _counters_kept(module: torch.nn.Module):
    """The module's int64 buffers (the running routing counters) as they were on entry, again
    on exit."""
    saved = [(b, b.clone()) for b in module.buffers() if b.dtype == torch.int64]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
