"""Balancing that needs the whole update: loss-free balancing's bias update and the global-batch
balance loss's counts, for the feedforward MoEs (sigma-MoE, Switch) and token-choice
Mixture-of-Recursions (its depths are the "experts": moeify.layers.recursion). Applied from outside the
model: layers never touch torch.distributed, and everything here is read from what the model's
forward *returns* (LMOutput.routing, LMOutput.balance), never from state a layer fills as it runs.
Activation recomputation (torch.utils.checkpoint, moeify.train.activation_checkpointing) runs a
block's forward a second time during backward; the returned records exist once per forward of
the model, so nothing is counted twice.

Loss-free balancing (Wang et al. 2024, arXiv 2408.15664, Algorithm 1; DeepSeek-V3 §2.1.2). A
layer with ``lossfree_rate = gamma > 0`` holds a bias b [E] added to its routing scores for the
top-k choice only. After each optimizer step:

    c_i  = tokens routed to expert i during the update: every micro-batch, every process, every
           layer position that uses the module (shared blocks)
    b_i += gamma * sign(mean_j c_j - c_i)                 (no centring unless lossfree_centre)

One all-reduce (sum) per update carries the counts of every feedforward router; every process
then computes the same bias.

Global-batch balance loss (Qiu et al. 2025, arXiv 2501.11873; Switch with
``balance_scope="global"``): the balance loss's f_i comes from the top-1 counts of the global
batch instead of the micro-batch. The model returns each such loss's parts (``GlobalBalance``:
the differentiable mean router probabilities P_i and this forward's top-1 counts, keyed by layer
position); after each micro-batch's forward the counts are all-reduced (summed) over the
processes, one all-reduce for every layer, and added to the counts of the update's earlier
micro-batches (the paper's buffer over gradient-accumulation steps), and the loss is taken with
them: the last micro-batch of an update sees the counts of the whole global batch. The counts
carry no gradient. Validation, which never comes here, takes the per-batch loss.

ReMoE's adaptive L1 coefficient (Wang et al., ICLR 2025, arXiv 2412.14711, Sec. 3;
moeify.layers.remoe): after each optimizer step the sparsity S of every ReMoE layer's routing
over the update (its records' last column counts the (token, expert) pairs not routed; summed
over micro-batches, processes and ReMoE layers, in the same all-reduce) moves each layer's
lambda by alpha toward the target 1 - k/E (``ReMoE.update_l1_coef``, on the device).

Shape legend: E router outputs of a layer.
"""

from __future__ import annotations

import torch

from moeify.models.lm import feedforward_of
from moeify.ops.aux_losses import loss_free_bias_update
from moeify.train.distributed import DistEnv

# The routing kinds (RoutingStats.kind) of the feedforward MoEs' routers.
FEEDFORWARD_KINDS = ("sigma_moe", "switch", "remoe")
# The routing kind of a block-level router: Mixture-of-Recursions (tokens by depth).
RECURSION_KIND = "mor"


def _lossfree(module) -> bool:
    return getattr(getattr(module, "config", None), "lossfree_rate", 0.0) > 0


class Balancing:
    """The per-update balancing state of one training run (built once by the trainer)."""

    def __init__(self, model: torch.nn.Module, env: DistEnv) -> None:
        self.env = env
        # The feedforward of every layer position (its routing records carry the position).
        self.feedforwards = [feedforward_of(b) for b in model.layer_blocks()]
        # Mixture-of-Recursions modules with loss-free balancing, by layer position
        self.recursions = {i: b for i, b in enumerate(model.layer_blocks()) if _lossfree(b)}
        self.lossfree = {ff for ff in self.feedforwards if _lossfree(ff)} | set(
            self.recursions.values())
        if any(_lossfree(m) and m not in self.lossfree for m in model.modules()):
            raise ValueError("loss-free balancing (lossfree_rate > 0) works on the feedforwards "
                             "of the model's blocks, not inside Mixture-of-Recursions; set "
                             "model.feedforward.lossfree_rate=0 for this model")
        self.remoe = {ff for ff in self.feedforwards if hasattr(ff, "update_l1_coef")}
        self._counts: dict[str, torch.Tensor] = {}  # routing key -> the update's counts so far
        self._owner: dict[str, torch.nn.Module] = {}  # routing key -> its feedforward
        self._global: dict[str, torch.Tensor] = {}  # balance key -> the update's top-1 counts

    def start_step(self) -> None:
        self._counts.clear()
        self._global.clear()

    def after_forward(self, out) -> torch.Tensor:
        """After one micro-batch's forward: collect its routed counts (every feedforward
        router's, for the load log and loss-free balancing) and take its global-batch balance
        losses with the update's counts so far (module docstring). Returns the aux loss to
        train on: ``out.aux_loss`` with those losses retaken (``out.losses`` holds them)."""
        seen = set()
        for key, rec in out.routing.items():
            if rec.kind in FEEDFORWARD_KINDS:
                owner = self.feedforwards[rec.layer]
            elif rec.kind == RECURSION_KIND and rec.layer in self.recursions:
                owner = self.recursions[rec.layer]
            else:
                continue
            c = rec.counts[0]
            self._counts[key] = c if key not in self._counts else self._counts[key] + c
            self._owner[key] = owner
            seen.add(owner)
        missing = (self.lossfree | self.remoe) - seen
        if missing:
            raise RuntimeError(f"loss-free balancing / ReMoE: the model returned no routing "
                               f"record of {type(next(iter(missing))).__name__}")
        if not out.balance:
            return out.aux_loss
        keys = sorted(out.balance)
        flat = torch.cat([out.balance[k].counts.detach().float().reshape(-1) for k in keys])
        self.env.all_reduce_sum_(flat)
        for key, c in zip(keys, flat.split([out.balance[k].counts.numel() for k in keys])):
            total = c if key not in self._global else self._global[key] + c
            self._global[key] = total
            out.losses[key] = out.balance[key].loss(total)
        return torch.stack([v.float() for v in out.losses.values()]).sum()

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
        for m in self.lossfree:
            c = sum(total[k] for k in keys if self._owner[k] is m)
            cfg = m.config
            m.expert_bias.copy_(loss_free_bias_update(
                m.expert_bias, c, cfg.lossfree_rate,
                centre=getattr(cfg, "lossfree_centre", False)))
        remoe_keys = [k for k in keys if self._owner[k] in self.remoe]
        if remoe_keys:
            c = sum(total[k] for k in remoe_keys)  # [E + 1]: the experts, then not routed
            sparsity = c[-1] / c.sum().clamp_min(1)
            for m in self.remoe:
                m.update_l1_coef(sparsity)
        self._counts.clear()
        return total
