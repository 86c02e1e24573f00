"""Balancing that needs the whole update: loss-free balancing's bias update and the global-batch
balance loss's counts, for the feedforward MoEs (sigma-MoE, Switch). Applied from outside the
model (ARCHITECTURE: layers never touch torch.distributed).

Loss-free balancing (Wang et al. 2024, arXiv 2408.15664, Algorithm 1; DeepSeek-V3 §2.1.2). A
layer with ``lossfree_rate = gamma > 0`` holds a bias b [E] added to its routing scores for the
top-k choice only. After each optimizer step:

    c_i  = tokens routed to expert i during the update: every micro-batch, every process, every
           layer position that uses the module (shared blocks)
    b_i += gamma * sign(mean_j c_j - c_i)                 (no centring unless lossfree_centre)

The counts are read from the routing records the model's forward *returns* (LMOutput.routing),
never from a buffer the layer fills as it runs: activation recomputation (torch.utils.checkpoint)
runs a layer's forward a second time during backward, and would count its tokens twice; the
returned records exist once per forward of the model. One all-reduce (sum) per update carries
the counts of every such layer; every process then computes the same bias.

Global-batch balance loss (Qiu et al. 2025, arXiv 2501.11873; Switch with
``balance_scope="global"``): the balance loss's f_i comes from the top-1 counts of the global
batch instead of the micro-batch. The layer asks ``count_sync`` (installed here) for them: this
micro-batch's counts are all-reduced (summed) over the processes and added to the counts of the
update's earlier micro-batches (the paper's buffer over gradient-accumulation steps), so the last
micro-batch of an update sees the counts of the whole global batch. The counts carry no gradient.
Only training forwards synchronise (validation may run on one process).

ReMoE's adaptive L1 coefficient (Wang et al., ICLR 2025, arXiv 2412.14711, Sec. 3;
moeify.layers.remoe): after each optimizer step the sparsity S of every ReMoE layer's routing
over the update (the records' last column counts the (token, expert) pairs not routed, summed
over micro-batches, processes and layers) moves each layer's lambda by alpha toward the target
1 - k/E (``ReMoE.update_l1_coef``, on the device).

Shape legend: E router outputs of a layer.
"""

from __future__ import annotations

import torch

from moeify.ops.aux_losses import loss_free_bias_update
from moeify.train.distributed import DistEnv


def feedforward_of(block: torch.nn.Module) -> torch.nn.Module | None:
    """The feedforward of a TransformerBlock, looking through a depth-routing wrapper."""
    ff = getattr(block, "feedforward", None)
    if ff is None and hasattr(block, "block"):
        ff = getattr(block.block, "feedforward", None)
    return ff


class Balancing:
    """The per-update balancing state of one training run (built once by the trainer)."""

    def __init__(self, model: torch.nn.Module, env: DistEnv) -> None:
        self.env = env
        # Loss-free: module -> the routing-record keys of its layer positions.
        self.lossfree: dict[torch.nn.Module, list[str]] = {}
        self.global_layers: list[torch.nn.Module] = []
        # ReMoE: module -> the routing-record keys of its layer positions.
        self.remoe: dict[torch.nn.Module, list[str]] = {}
        for i, block in enumerate(model.layer_blocks()):
            ff = feedforward_of(block)
            cfg = getattr(ff, "config", None)
            if cfg is None:
                continue
            if hasattr(ff, "update_l1_coef"):
                self.remoe.setdefault(ff, []).append(f"layers.{i}.ff.router")
            if getattr(cfg, "lossfree_rate", 0.0) > 0:
                self.lossfree.setdefault(ff, []).append(f"layers.{i}.ff.router")
            if (getattr(cfg, "balance_scope", "batch") == "global"
                    and getattr(cfg, "balance_coef", 0) != 0 and ff not in self.global_layers):
                self.global_layers.append(ff)
        self._counts: dict[str, torch.Tensor] = {}
        self._prev: dict[torch.nn.Module, torch.Tensor] = {}
        self._pending: dict[torch.nn.Module, list[torch.Tensor]] = {}
        for ff in self.global_layers:
            ff.count_sync = self._sync_fn(ff)

    @property
    def active(self) -> bool:
        return bool(self.lossfree or self.global_layers or self.remoe)

    def _sync_fn(self, ff: torch.nn.Module):
        def sync(counts_E: torch.Tensor) -> torch.Tensor:
            if not ff.training:  # validation may run on process 0 alone: no collective
                return counts_E
            c = counts_E.detach().to(torch.float32).clone()
            self.env.all_reduce_sum_(c)
            self._pending.setdefault(ff, []).append(c)
            prev = self._prev.get(ff)
            return c if prev is None else prev + c
        return sync

    def start_step(self) -> None:
        self._counts.clear()
        self._prev.clear()
        self._pending.clear()

    def after_forward(self, out) -> None:
        """After one micro-batch's forward: collect its routed counts (every feedforward
        router's, for the load log and loss-free balancing) and fold its global counts into the
        update's running sum (global-batch loss)."""
        for ff, keys in list(self.lossfree.items()) + list(self.remoe.items()):
            missing = [k for k in keys if k not in out.routing]
            if missing:
                raise RuntimeError(f"loss-free balancing / ReMoE: the model returned no routing "
                                   f"record {missing[0]!r}")
        for key, rec in out.routing.items():
            if key.endswith("ff.router"):
                c = rec.counts[0]
                self._counts[key] = c if key not in self._counts else self._counts[key] + c
        for ff in self.global_layers:
            for c in self._pending.pop(ff, []):
                self._prev[ff] = c if ff not in self._prev else self._prev[ff] + c

    @torch.no_grad()
    def after_optimizer_step(self) -> dict[str, torch.Tensor]:
        """Once per optimizer step: the update's per-expert counts of every feedforward router
        summed over micro-batches and processes (one all-reduce), the loss-free bias updates
        and ReMoE's coefficient updates from them; returns the counts by routing key (the
        trainer logs them)."""
        keys = sorted(self._counts)
        if not keys:
            return {}
        flat = torch.cat([self._counts[k].to(torch.float64).reshape(-1) for k in keys])
        self.env.all_reduce_sum_(flat)
        total = dict(zip(keys, flat.split([self._counts[k].numel() for k in keys])))
        for m, mkeys in self.lossfree.items():
            c = sum(total[k] for k in mkeys)
            cfg = m.config
            m.expert_bias.copy_(loss_free_bias_update(m.expert_bias, c, cfg.lossfree_rate,
                                                      centre=cfg.lossfree_centre))
        if self.remoe:
            c = sum(total[k] for keys in self.remoe.values() for k in keys)  # [1, E + 1]
            sparsity = c[..., -1].sum() / c.sum().clamp_min(1)
            for m in self.remoe:
                m.update_l1_coef(sparsity)
        self._counts.clear()
        return total
