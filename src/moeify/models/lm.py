"""TransformerLM: the decoder-only language model of the SwitchHead appendix, assembled from layers.

    x = Drop(Embed(ids) [+ Pos(p)])           embedding std 1/sqrt(d); Pos: learned absolute
                                              positions when max_positions > 0 (GPT-2)
    x = block_l(x, mem_l)   for l = 1..L      pre-norm blocks, optionally wrapped by depth routing
    logits = Out(Drop(Norm(x)))               untied Linear(d, V) with bias (the papers), or
                                              without bias, or tied to the embedding (x Eᵀ)

Learned positions count from the first token of the sequence; with a cache, from the number of
tokens the longest per-block cache holds (every block's cache holds every token unless it is
routed by Mixture-of-Depths, so at least one plain block is needed for exact positions).

XL memory: ``mem_l`` is the input of block l for the previous chunk, detached (one chunk of
memory). The caller carries it: pass ``output.memory`` of one call as ``memory=`` of the next.
Without ``xl_memory`` (the paper's RoPE models) no memory is kept or returned.

Shape legend: B batch, T tokens of this call, M memory tokens, D d_model, V vocabulary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moeify.layers.block import TransformerBlock
from moeify.layers.common import Dropout, GlobalBalance, PooledEntropy, RoutingStats
from moeify.layers.depth import MixtureOfDepths
from moeify.layers.moeut import PeriNormBlock
from moeify.layers.norm import NormConfig
from moeify.layers.recursion import MixtureOfRecursions
from moeify.ops.aux_losses import masked_mean
from moeify.ops.cross_entropy import fused_applies, linear_cross_entropy


class LMConfig(Protocol):
    """What TransformerLM reads of its configuration: moeify.models.config.ModelConfig (which
    builds this module's model, so this module does not import it) has all of it."""

    vocab_size: int
    d_model: int
    n_layers: int
    xl_memory: bool
    dropout: float
    norm: NormConfig
    max_positions: int
    tie_embeddings: bool
    output_bias: bool
    group_size: int
    block: str
    recursion: Any

    @property
    def n_blocks(self) -> int: ...

    def attention_layers(self) -> list[Any]: ...

    def feedforward_layers(self) -> list[Any]: ...

    def depth_layers(self) -> list[Any]: ...


@dataclass
class LMOutput:
    """loss:     mean cross-entropy over the valid targets (None without targets), float32.
                 It does NOT include the auxiliary losses: train on ``total_loss``.
    logits:   [B, T, V]; None when the caller passed targets and ``return_logits=False``.
    aux_loss: sum over every layer of its Aux.losses (already weighted by their coefficients);
              a zero tensor when no layer has one.
    losses:   the individual aux losses, keyed "layers.{i}.{name}"; a pooled one (MoEUT's
              entropy regularisers: over every application of a shared block) once per block,
              keyed by the block's first layer i = block index.
    stats:    detached per-layer statistics, keyed "layers.{i}.{name}": each layer's own, and
              for every routing record "layers.{i}.{record}.{metric}" (RoutingStats.metrics:
              counts, usage_entropy, dead_experts, gate_mean), the names training logs.
              Computed on first access (decoding, which never reads them, skips a dozen small
              ops per routing record and token).
    routing:  the routing records (RoutingStats, ``layer`` set), keyed "layers.{i}.{record}"
              (e.g. "layers.0.attn.src", "layers.1.ff.router", "layers.1.mod").
    balance:  the global-batch balance losses (``GlobalBalance``), keyed as in ``losses``, where
              each is taken over this forward's tokens; a trainer retakes them with the counts
              of its whole update (moeify.train.balancing).
    memory:   the XL memory for the next call (list of [B, T, D], detached), or None.
    """

    loss: torch.Tensor | None
    logits: torch.Tensor | None
    aux_loss: torch.Tensor
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    layer_stats: dict[str, torch.Tensor] = field(default_factory=dict)
    memory: list[torch.Tensor] | None = None
    routing: dict[str, RoutingStats] = field(default_factory=dict)
    balance: dict[str, GlobalBalance] = field(default_factory=dict)

    @property
    def total_loss(self) -> torch.Tensor | None:
        return None if self.loss is None else self.loss + self.aux_loss

    @functools.cached_property
    def stats(self) -> dict[str, torch.Tensor]:
        out = dict(self.layer_stats)
        for key, r in self.routing.items():
            out.update({f"{key}.{m}": v for m, v in r.metrics().items()})
        return out


class TransformerLM(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        d, V = config.d_model, config.vocab_size
        self.embedding = nn.Embedding(V, d)
        if config.max_positions:
            self.pos_embedding = nn.Embedding(config.max_positions, d)
        self.drop = Dropout(config.dropout)
        self.blocks = self._build_blocks(config)
        self.ln_f = config.norm.build(d)
        # Tied: the logits are x Eᵀ with the embedding's own parameter (no second copy to save).
        self.output = None if config.tie_embeddings else nn.Linear(d, V, bias=config.output_bias)
        self.reset_parameters()

    def _build_blocks(self, config: LMConfig) -> nn.ModuleList:
        """One block per layer, or with MoEUT's grouping (config.group_size = G) the first G,
        which ``layer_blocks`` repeats, or with Mixture-of-Recursions the unshared blocks and
        the recursion module (``build_recursion_blocks``)."""
        layers = list(zip(config.attention_layers(), config.feedforward_layers(),
                          config.depth_layers()))
        if getattr(config, "recursion", None) is not None:
            return build_recursion_blocks(config, layers)
        return nn.ModuleList(build_block(config, attn, ff, depth)
                             for attn, ff, depth in layers[:config.n_blocks])

    def layer_blocks(self) -> list[nn.Module]:
        """The module applied at each step of the forward pass: one per layer (shared ones
        repeat), or with Mixture-of-Recursions the blocks in order (its module is one step)."""
        if getattr(self.config, "recursion", None) is not None:
            return list(self.blocks)
        return [self.blocks[i % len(self.blocks)] for i in range(self.config.n_layers)]

    def reset_parameters(self) -> None:
        """Embedding and output layer only; every layer initialises itself (§3)."""
        d = self.config.d_model
        nn.init.normal_(self.embedding.weight, std=d ** -0.5)  # SwitchHead appendix
        if self.config.max_positions:  # not in the papers: the token embedding's scale
            nn.init.normal_(self.pos_embedding.weight, std=d ** -0.5)
        if self.output is None:
            return
        # The spec leaves the output layer's init open: the same 1/sqrt(fan_in) scale, bias 0.
        nn.init.normal_(self.output.weight, std=d ** -0.5)
        if self.output.bias is not None:
            nn.init.zeros_(self.output.bias)

    def new_cache(self) -> list:
        """One attention KV cache per block, for incremental decoding: call ``forward`` with
        ``cache=`` on successive pieces of a sequence (the first piece may be the whole prompt)
        and the logits equal those of one full forward pass without memory (Switch feedforwards:
        of the dropless model, moeify.layers.switch_ff's decoding rule)."""
        return [b.new_cache() if isinstance(b, MixtureOfRecursions) else
                attention_of(b).new_cache() for b in self.layer_blocks()]

    def forward(
        self,
        ids_BT: torch.Tensor,
        targets_BT: torch.Tensor | None = None,
        *,
        memory: list[torch.Tensor] | None = None,
        cache: list | None = None,
        valid_BT: torch.Tensor | None = None,
        return_logits: bool = True,
    ) -> LMOutput:
        """``memory``: the previous call's ``output.memory`` (XL models only; None on the first
        chunk). ``cache``: from ``new_cache()``, for decoding (not combined with memory).
        ``valid_BT``: False for padding; padded targets do not count in the loss.
        ``return_logits=False`` (with targets; what training passes): ``logits`` is None and the
        loss may come from the fused output layer + cross-entropy, which keeps no [B, T, V]
        tensor for backward (moeify.ops.cross_entropy; same loss and gradients)."""
        cfg = self.config
        self._check_forward_args(ids_BT, targets_BT, memory, cache, valid_BT)
        x_BTD = self.drop(self._embed(ids_BT, cache))
        keep_memory = cfg.xl_memory and cache is None
        new_memory: list[torch.Tensor] = []
        losses: dict[str, torch.Tensor] = {}
        stats: dict[str, torch.Tensor] = {}
        routing: dict[str, RoutingStats] = {}
        pooled: dict[str, PooledEntropy] = {}
        balance: dict[str, GlobalBalance] = {}
        for i, block in enumerate(self.layer_blocks()):
            if keep_memory:
                new_memory.append(x_BTD.detach())
            mem_BMD = None if memory is None else memory[i]
            x_BTD, aux = block(x_BTD, mem_BMD, cache=None if cache is None else cache[i],
                               valid_BT=valid_BT)
            for k, v in aux.losses.items():
                losses[f"layers.{i}.{k}"] = v
            for k, v in aux.stats.items():
                stats[f"layers.{i}.{k}"] = v
            for k, r in aux.routing.items():
                routing[f"layers.{i}.{k}"] = r.with_layer(i)
            for k, b in aux.balance.items():
                balance[f"layers.{i}.{k}"] = b
                losses[f"layers.{i}.{k}"] = b.loss()
            # Pooled terms (MoEUT's regularisers) add up over every application of a block
            # (layer i runs block i mod G) and are keyed by its first layer, i mod G.
            for k, p in aux.pooled.items():
                key = f"layers.{i % len(self.blocks)}.{k}"
                pooled[key] = pooled[key].merge(p) if key in pooled else p
        for key, p in pooled.items():
            losses[key] = p.loss()
        logits_BTV, loss = self._head(self.drop(self.ln_f(x_BTD)), targets_BT, valid_BT,
                                      return_logits)
        aux_loss = (torch.stack([v.float() for v in losses.values()]).sum() if losses
                    else x_BTD.new_zeros((), dtype=torch.float32))
        return LMOutput(loss=loss, logits=logits_BTV, aux_loss=aux_loss, losses=losses,
                        layer_stats=stats, memory=new_memory if keep_memory else None,
                        routing=routing, balance=balance)

    def _check_forward_args(self, ids_BT, targets_BT, memory, cache, valid_BT) -> None:
        """ValueError (what to pass instead) for inputs ``forward`` cannot use."""
        cfg = self.config
        if ids_BT.dim() != 2:
            raise ValueError(f"ids_BT must be [batch, tokens], got shape {tuple(ids_BT.shape)}")
        if ids_BT.is_floating_point() or ids_BT.is_complex() or ids_BT.dtype == torch.bool:
            raise ValueError(f"ids_BT must hold integer token ids, got dtype {ids_BT.dtype}")
        for name, t in (("targets_BT", targets_BT), ("valid_BT", valid_BT)):
            if t is not None and t.shape != ids_BT.shape:
                raise ValueError(f"{name} must have the shape of ids_BT {tuple(ids_BT.shape)}, "
                                 f"got {tuple(t.shape)}")
        if memory is not None and not cfg.xl_memory:
            raise ValueError("memory was passed to a model without xl_memory; pass memory=None "
                             "or build the model with xl_memory=True")
        if memory is not None and cache is not None:
            raise ValueError("pass either memory (chunked XL training/evaluation) or cache "
                             "(incremental decoding), not both")
        if memory is not None and len(memory) != cfg.n_layers:
            raise ValueError(f"memory must hold one tensor per block ({cfg.n_layers}), "
                             f"got {len(memory)}")
        if memory is not None and any(m.dim() != 3 or m.shape[0] != ids_BT.shape[0]
                                      or m.shape[2] != cfg.d_model for m in memory):
            raise ValueError(f"memory tensors must be [batch={ids_BT.shape[0]}, tokens, "
                             f"d_model={cfg.d_model}], got {[tuple(m.shape) for m in memory]}: "
                             "pass the previous call's output.memory for the same batch rows, "
                             "or memory=None to start afresh")
        steps = len(self.layer_blocks())
        if cache is not None and len(cache) != steps:
            raise ValueError(f"cache must hold one entry per block ({steps}); "
                             "make it with model.new_cache()")

    def _embed(self, ids_BT: torch.Tensor, cache: list | None) -> torch.Tensor:
        x_BTD = self.embedding(ids_BT)
        P = self.config.max_positions
        if not P:
            return x_BTD
        past = max((len(c) for c in cache), default=0) if cache is not None else 0
        T = ids_BT.shape[1]
        if past + T > P:
            raise ValueError(f"the model has learned positions for {P} tokens; this call reaches "
                             f"position {past + T}: use shorter sequences (or a generation "
                             "window)")
        return x_BTD + self.pos_embedding(torch.arange(past, past + T, device=ids_BT.device))

    def _head(self, h_BTD, targets_BT, valid_BT, return_logits: bool):
        """(logits or None, loss or None) from the final hidden states (``forward``)."""
        w_VD = self.embedding.weight if self.output is None else self.output.weight
        if (not return_logits and targets_BT is not None and torch.is_grad_enabled()
                and fused_applies(h_BTD, w_VD)):
            b_V = None if self.output is None else self.output.bias
            valid_N = None if valid_BT is None else valid_BT.flatten()
            return None, linear_cross_entropy(h_BTD.flatten(0, 1), w_VD, b_V,
                                              targets_BT.flatten(), valid_N)
        logits_BTV = self.logits(h_BTD)
        loss = None if targets_BT is None else lm_loss(logits_BTV, targets_BT, valid_BT)
        return (logits_BTV if return_logits or targets_BT is None else None), loss

    def logits(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """The output layer on normalised hidden states [B, T, D] -> [B, T, V]."""
        if self.output is None:
            return h_BTD @ self.embedding.weight.t()
        return self.output(h_BTD)


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor,
            valid_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy in float32 over the valid positions (all when None)."""
    ce_BT = F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten(),
                            reduction="none").view_as(targets_BT)
    return masked_mean(ce_BT, valid_BT)


def build_block(config: LMConfig, attn, ff, depth) -> nn.Module:
    """One layer: a pre-LN block of ``attn`` and ``ff``, wrapped by depth routing if ``depth``."""
    cls = PeriNormBlock if config.block == "peri_ln" else TransformerBlock
    block = cls(config.d_model, attn.build(), ff.build(), config.dropout, norm=config.norm)
    if depth is None:
        return block
    return MixtureOfDepths(depth, block)


def feedforward_of(block: nn.Module) -> nn.Module | None:
    """The feedforward module of a block, looking through a depth-routing wrapper; None for a
    step that is not one block (Mixture-of-Recursions' module)."""
    while not isinstance(block, TransformerBlock):
        block = getattr(block, "block", None)
        if block is None:
            return None
    return block.feedforward


def build_recursion_blocks(config: LMConfig, layers: list) -> nn.ModuleList:
    """Mixture-of-Recursions (layers/recursion.py): the unshared first and last layer (Middle-
    Cycle) around the recursion module, whose shared stack is built from the layer configs that
    follow the first layer (Cycle: from the first ones)."""
    mor = config.recursion
    start, size = mor.stack_layers(config.n_layers)
    stack = nn.ModuleList(build_block(config, *layer) for layer in layers[start:start + size])
    blocks = [mor.build(stack)]
    if start:
        blocks = [build_block(config, *layers[0])] + blocks + [build_block(config, *layers[-1])]
    return nn.ModuleList(blocks)


def attention_of(block: nn.Module) -> nn.Module:
    """The attention module of a block, looking through a depth-routing wrapper."""
    while not isinstance(block, TransformerBlock):
        block = block.block
    return block.attention
