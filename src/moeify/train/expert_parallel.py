"""Expert parallelism for the feedforward MoEs (sigma-MoE, Switch), applied from outside the model
(ARCHITECTURE: layers never touch torch.distributed). The design follows torchtitan's
distributed/expert_parallel.py: experts split along dim 0 over an "ep" mesh dimension, token
counts exchanged first, tokens dispatched by all-to-all, the local experts run, results combined.

Mesh. W processes form a 2-D DeviceMesh ("dp", "ep") of shape (W / P, P), P = expert_parallel.
The P processes of one ep group each hold E / P experts of every MoE feedforward (expert e lives
on ep rank e // (E / P)): the stacked expert weights ``w_in`` / ``w_gate`` / ``w_out`` and the
per-expert hidden bias ``bias_in`` (moeify.layers.common: the naming convention) become
Parameters of E / P rows, this process's Shard(0) of the full tensor. Everything else
(attention, embeddings, routers, shared experts, norms) is replicated and averaged over all W
processes by DDP as before.

One MoE forward on each process (``dispatch``, injected as the layer's ``dispatch``):

 1. its routed (token, expert) pairs, dropped ones left out, sorted by expert: counts per expert;
 2. the counts are exchanged (all_to_all_single): each process learns how many rows every peer
    sends to each of its local experts; the host reads the splits (the one sync of EP);
 3. the rows travel to their experts' process: ``all_to_all_single_autograd`` with uneven
    splits (its backward is the reverse all-to-all);
 4. the local experts run through the layer's own expert op (moeify.ops.moe.expert_mlp via the
    layer's ``_mlp``), gate 1;
 5. the outputs travel back (the reverse all-to-all) and are combined at the token's process:
    gate times output, summed over the token's choices.

Routing, capacity and the aux losses stay on the token's process, so the model computes what
data-parallel training computes: dropless routing equals the single-process model exactly (up
to float round-off: the gate multiplies after the expert instead of inside it). Capacity is
per process as in plain DDP: ceil(M_local · k / E · factor) of the process's own M_local rows,
not of the global batch (the same meaning as data parallelism without EP).

Gradients. The all-to-all backward brings every peer's gradient to the expert shards, so after
backward a shard holds the sum over its ep group; ``sync_grads`` sums it over the dp group and
divides by W, which is DDP's average over all processes. DDP itself ignores the expert shards.
The clipping norm adds the shards' squared norms over the ep group (``clip_grad_norm_``).

Checkpoints hold full tensors: ``full_state`` gathers the shards (and their AdamW moments) over
the ep group, ``load_full_state`` keeps this process's rows. A checkpoint written at one degree
resumes at any other, or in one process (eval, generate, export read it as any checkpoint).

Shape legend: M tokens, K choices, N kept pairs, R rows received, D d_model, E experts, P ep
degree, L = E / P local experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeify.layers.common import upgrade_legacy_keys
from moeify.layers.sigma_moe import SigmaMoE
from moeify.layers.switch_ff import SwitchFeedForward
from moeify.ops.routing import count_ids

EXPERT_PARAMS = {SigmaMoE: ("w_in", "w_out", "bias_in"),
                 SwitchFeedForward: ("w_in", "w_gate", "w_out", "bias_in")}


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The distinct expert-parallel-capable feedforwards of ``model``."""
    return [m for m in model.modules() if type(m) in EXPERT_PARAMS]


class ExpertParallel:
    """The expert-parallel state of a run: the mesh, the sharded layers, the collectives."""

    def __init__(self, model: nn.Module, degree: int, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        W = dist.get_world_size() if dist.is_initialized() else 1
        if degree < 1 or W % degree:
            raise ValueError(f"expert_parallel={degree} must divide the number of processes "
                             f"({W}); choose a divisor of {W}")
        self.W, self.P = W, degree
        self.mesh = init_device_mesh(device.type, (W // degree, degree),
                                     mesh_dim_names=("dp", "ep"))
        self.ep_group = self.mesh.get_group("ep")
        self.dp_group = self.mesh.get_group("dp")
        self.ep_rank = self.mesh.get_local_rank("ep")
        self.model = model  # its names: the checkpoint's keys (load_full_state)
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("expert_parallel > 1 needs a model with sigma-MoE or Switch "
                             "feedforwards")
        self.params: dict[str, nn.Parameter] = {}  # qualified name -> local shard
        names = {id(m): n for n, m in model.named_modules()}
        for layer in self.layers:
            E = layer.config.n_experts
            if E % degree:
                raise ValueError(f"expert_parallel={degree} must divide every MoE layer's "
                                 f"n_experts (a layer has {E})")
            L = E // degree
            for pname in EXPERT_PARAMS[type(layer)]:
                full = getattr(layer, pname, None)
                if full is None:
                    continue
                shard = full.detach()[self.ep_rank * L:(self.ep_rank + 1) * L].clone()
                setattr(layer, pname, nn.Parameter(shard))  # same slot: parameter order kept
                prefix = names[id(layer)]
                self.params[f"{prefix}.{pname}" if prefix else pname] = getattr(layer, pname)
            layer.dispatch = self.dispatch

    # ------------------------------------------------------------------ forward

    def dispatch(self, layer: nn.Module, x_MD: torch.Tensor, idx_MK: torch.Tensor,
                 gates_MK: torch.Tensor, keep_MK: torch.Tensor | None) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        M, K = idx_MK.shape
        E, P = layer.config.n_experts, self.P
        L = E // P
        ids_N = idx_MK.reshape(-1)
        keep_N = ids_N < E  # no-op experts (integrated MoDE) compute nothing
        if keep_MK is not None:
            keep_N = keep_N & keep_MK.reshape(-1)
        pairs = torch.nonzero(keep_N).squeeze(1)
        ids = ids_N[pairs]
        order = torch.argsort(ids, stable=True)
        pairs, ids = pairs[order], ids[order]
        send_E = count_ids(ids, E)
        recv_E = torch.empty_like(send_E)  # [P sources x L local experts]
        dist.all_to_all_single(recv_E, send_E, group=self.ep_group)
        splits = torch.stack([send_E.view(P, L).sum(1), recv_E.view(P, L).sum(1)]).tolist()
        send_split, recv_split = splits
        x_ND = x_MD.index_select(0, torch.div(pairs, K, rounding_mode="floor"))
        x_RD = all_to_all_single_autograd(x_ND, recv_split, send_split, self.ep_group)
        local_R = torch.arange(L, device=x_MD.device).repeat(P).repeat_interleave(recv_E)
        if x_RD.shape[0]:
            ones = torch.ones(x_RD.shape[0], 1, dtype=torch.float32, device=x_MD.device)
            y_RD = layer._mlp(x_RD, local_R[:, None], ones)
        else:  # nothing to compute here; the reverse all-to-all must still run in backward
            y_RD = x_RD * 0.0
        y_ND = all_to_all_single_autograd(y_RD, send_split, recv_split, self.ep_group)
        g_N = gates_MK.reshape(-1)[pairs]
        y_ND = y_ND * g_N[:, None].to(y_ND.dtype)
        out = torch.zeros(M, x_MD.shape[1], dtype=y_ND.dtype, device=x_MD.device)
        return out.index_add(0, torch.div(pairs, K, rounding_mode="floor"), y_ND)

    # ------------------------------------------------------------------ gradients

    def ignore_in_ddp(self, model: nn.Module) -> None:
        """Tell DDP (before wrapping) not to all-reduce the expert shards."""
        from torch.nn.parallel import DistributedDataParallel

        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, list(self.params))

    @torch.no_grad()
    def sync_grads(self) -> None:
        """After the update's last backward: expert gradients summed over the dp group and
        divided by W (DDP's average over all processes; module docstring)."""
        grads = []
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.W // self.P > 1:
            dist.all_reduce(flat, group=self.dp_group)
        flat.div_(self.W)
        for g, v in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(v.view_as(g))

    @torch.no_grad()
    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ over the whole model: replicated gradients count once, the
        expert shards' squared norms are summed over the ep group."""
        expert = {id(p) for p in self.params.values()}
        params = [p for p in params if p.grad is not None]
        sq = torch.zeros(2, dtype=torch.float64, device=params[0].grad.device)
        for p in params:
            sq[0 if id(p) in expert else 1] += p.grad.detach().double().square().sum()
        shard_sq = sq[:1].clone()
        dist.all_reduce(shard_sq, group=self.ep_group)
        total = (shard_sq[0] + sq[1]).sqrt().float()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
        return total

    # ------------------------------------------------------------------ checkpoints

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.P)]
        dist.all_gather(parts, t.contiguous(), group=self.ep_group)
        return torch.cat(parts, 0)

    def _narrow(self, full: torch.Tensor) -> torch.Tensor:
        L = full.shape[0] // self.P
        return full[self.ep_rank * L:(self.ep_rank + 1) * L]

    @torch.no_grad()
    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """(model state dict, optimizer state dict) with full expert tensors. Collective."""
        state = model.state_dict()
        for name in self.params:
            state[name] = self._gather(state[name])
        opt = optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                                 for p in g["params"])}
        for p in self.params.values():
            st = opt["state"].get(index[id(p)])
            if st is None:
                continue
            st = dict(st)
            for k, v in st.items():
                if torch.is_tensor(v) and v.shape == p.shape:
                    st[k] = self._gather(v)
            opt["state"][index[id(p)]] = st
        return state, opt

    @torch.no_grad()
    def load_full_state(self, model_state: dict, optimizer_state: dict | None,
                        optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
        """The state dicts of a full checkpoint narrowed to this process's expert rows (a
        checkpoint written with earlier parameter names is read by the current ones)."""
        model_state = upgrade_legacy_keys(self.model, model_state)
        for name in self.params:
            model_state[name] = self._narrow(model_state[name]).clone()
        if optimizer_state is None or optimizer is None:
            return model_state, optimizer_state
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                                 for p in g["params"])}
        opt = dict(optimizer_state)
        opt["state"] = dict(opt["state"])
        for p in self.params.values():
            i = index[id(p)]
            st = opt["state"].get(i, opt["state"].get(str(i)))
            if st is None:
                continue
            full_rows = p.shape[0] * self.P
            opt["state"][i] = {k: (self._narrow(v).clone() if torch.is_tensor(v) and v.dim()
                                   and v.shape[0] == full_rows and v.shape[1:] == p.shape[1:]
                                   else v) for k, v in st.items()}
        return model_state, opt
