"""Expert parallelism for the routed experts of the feedforward MoEs (sigma-MoE, Switch: every
``moeify.layers.experts.RoutedExperts``), applied from outside the model, as torchtitan applies
its ExpertParallel style to ``moe.experts``: expert weights are DTensors placed ``Shard(0)`` over
an "ep" mesh dimension, token counts are exchanged first, tokens dispatched by all-to-all, the
local experts run, results combined. The layers know nothing of it: they call their ``experts``
module with their routing decisions, whatever runs it.

Mesh. W processes form a 2-D DeviceMesh ("dp", "ep") of shape (W / P, P), P = expert_parallel.
``distribute_experts`` turns every parameter of a RoutedExperts module (all stacked with the
expert first: ``w_in`` / ``w_gate`` / ``w_out`` and the hidden bias ``bias_in``) into a
Parameter holding a DTensor of the full global shape [E, ...] on the 1-D "ep" sub-mesh with
placement ``Shard(0)``: each process stores E / P experts (expert e lives on ep rank
e // (E / P)), the P processes of an ep group together hold every expert, and the dp groups hold
replicas. Everything else (attention, embeddings, routers, shared experts, norms) is either
replicated and averaged by DDP (parallel=ddp) or sharded over all W processes by FSDP2
(parallel=fsdp, ``fully_shard(..., ignored_params=<the expert DTensors>)``). The module's
forward is replaced by the token movement below (``ExpertParallel.dispatch``), which runs the
local experts through the module's own ``run`` with the local shards.

One MoE forward on each process (``dispatch``):

 1. its routed (token, expert) pairs, the pairs not kept left out, sorted by expert: counts per
    expert;
 2. the counts are exchanged (all_to_all_single): each process learns how many rows every peer
    sends to each of its local experts; the host reads the splits (the one sync of EP);
 3. the rows travel to their experts' process: ``all_to_all_single_autograd`` with uneven
    splits (its backward is the reverse all-to-all);
 4. the local experts run (``RoutedExperts.run`` with the local shards, ``DTensor.to_local()``,
    whose backward returns a ``Shard(0)`` gradient), gate 1;
 5. the outputs travel back (the reverse all-to-all) and are combined at the token's process:
    gate times output, summed over the token's choices.

Routing, capacity and the aux losses stay on the token's process, so the model computes what
data-parallel training computes: dropless routing equals the single-process model exactly (up
to float round-off: the gate multiplies after the expert instead of inside it). Capacity is
per process as in plain DDP: ceil(M_local · k / E · factor) of the process's own M_local rows,
not of the global batch (the same meaning as data parallelism without EP).

Gradients. The all-to-all backward brings every peer's gradient to the expert shards, so after
backward a shard's gradient (a ``Shard(0)`` DTensor) holds the sum over its ep group;
``sync_grads`` sums it over the dp group and divides by W, which is DDP's (and FSDP's) average
over all processes. DDP ignores the expert shards, FSDP2 is told to. ``clip_grad_norm_`` adds
the squared norms of plain gradients once, of FSDP shards over all processes and of expert
shards over an ep group (one all-reduce).

Checkpoints are DCP sharded checkpoints (moeify.rundir.sharded): each tensor is stored with its
global shape and the offsets of every shard, so one written at any (dp, ep) layout loads at any
other, into FSDP or DDP runs, and into one plain process (eval, generate, export). Single-file
checkpoints of full tensors (written by one process) resume here too: ``load_full_state`` keeps
this process's rows.

Shape legend: M tokens, K choices, N kept pairs, R rows received, D d_model, E experts, P ep
degree, L = E / P local experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeify.layers.common import upgrade_legacy_keys
from moeify.layers.experts import RoutedExperts
from moeify.ops.routing import count_ids


def expert_modules(model: nn.Module) -> list[RoutedExperts]:
    """The distinct routed-experts modules of ``model``."""
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def expert_mesh(degree: int, device: torch.device):
    """The 2-D ("dp", "ep") DeviceMesh of W / degree x degree processes."""
    from torch.distributed.device_mesh import init_device_mesh

    W = dist.get_world_size() if dist.is_initialized() else 1
    if degree < 1 or W % degree:
        raise ValueError(f"expert_parallel={degree} must divide the number of processes "
                         f"({W}); choose a divisor of {W}")
    return init_device_mesh(device.type, (W // degree, degree), mesh_dim_names=("dp", "ep"))


def distribute_experts(experts: RoutedExperts, ep_mesh) -> dict[str, nn.Parameter]:
    """Turn every parameter of ``experts`` into a ``Shard(0)`` DTensor Parameter on the 1-D
    ``ep_mesh`` (in place, same attribute, so the parameter order is kept). Every process must
    hold the same full weights (the trainer seeds them alike); no communication. Returns the
    new Parameters by their name in the module."""
    from torch.distributed.tensor import DTensor, Shard

    P, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    E = experts.n_experts
    if E % P:
        raise ValueError(f"expert_parallel={P} must divide every MoE layer's n_experts (a "
                         f"layer has {E}); choose a divisor of {E}")
    L = E // P
    params: dict[str, nn.Parameter] = {}
    for name, full in experts.weights().items():
        local = full.detach()[rank * L:(rank + 1) * L].clone()
        dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False,
                                shape=full.shape, stride=full.stride())
        setattr(experts, name, nn.Parameter(dt, requires_grad=full.requires_grad))
        params[name] = getattr(experts, name)
    return params


class ExpertParallel:
    """The expert-parallel state of a run: the mesh, the sharded layers, the collectives."""

    def __init__(self, model: nn.Module, degree: int, device: torch.device) -> None:
        self.W = dist.get_world_size() if dist.is_initialized() else 1
        self.P = degree
        self.mesh = expert_mesh(degree, device)
        self.ep_mesh = self.mesh["ep"]
        self.ep_group = self.mesh.get_group("ep")
        self.dp_group = self.mesh.get_group("dp")
        self.ep_rank = self.mesh.get_local_rank("ep")
        self.model = model  # its names: the checkpoint's keys (load_full_state)
        names = {id(m): n for n, m in model.named_modules()}
        self.params: dict[str, nn.Parameter] = {}  # qualified name -> DTensor
        for experts in expert_modules(model):
            prefix = names[id(experts)]
            for name, p in distribute_experts(experts, self.ep_mesh).items():
                self.params[f"{prefix}.{name}" if prefix else name] = p
            experts.forward = self._forward_of(experts)
        if not self.params:
            raise ValueError("expert_parallel > 1 needs a model with routed experts (sigma-MoE "
                             "or Switch feedforwards)")

    def _forward_of(self, experts: RoutedExperts):
        """The forward that replaces ``experts``' own (RoutedExperts.forward's signature; the
        capacity's packing is left out: only kept pairs travel)."""
        def forward(x_MD, ids_MK, gates_MK, keep_MK=None, *, rows=None):
            return self.dispatch(experts, x_MD, ids_MK, gates_MK, keep_MK)
        return forward

    # ------------------------------------------------------------------ forward

    def dispatch(self, experts: RoutedExperts, x_MD: torch.Tensor, idx_MK: torch.Tensor,
                 gates_MK: torch.Tensor, keep_MK: torch.Tensor | None) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        M, K = idx_MK.shape
        E, P = experts.n_experts, self.P
        L = E // P
        ids_N = idx_MK.reshape(-1)
        keep_N = ids_N < E  # ids past the experts (no-op experts) compute nothing
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
        # output_size: the row count is known (and, compiled, the same symbol as x_RD's)
        local_R = torch.arange(L, device=x_MD.device).repeat(P).repeat_interleave(
            recv_E, output_size=x_RD.shape[0])
        # The local shards as plain tensors: to_local()'s backward hands the gradient back to
        # the DTensor parameter as a Shard(0) DTensor.
        weights = {n: w.to_local() for n, w in experts.weights().items()}
        if torch.compiler.is_compiling():
            y_RD = self._compiled_experts(experts, x_RD, local_R, weights,
                                          send_split + recv_split)
        elif x_RD.shape[0]:
            ones = torch.ones(x_RD.shape[0], 1, dtype=torch.float32, device=x_MD.device)
            y_RD = experts.run(x_RD, local_R[:, None], ones, weights)
        else:  # nothing to compute here; the reverse all-to-all must still run in backward
            y_RD = x_RD * 0.0
        y_ND = all_to_all_single_autograd(y_RD, send_split, recv_split, self.ep_group)
        g_N = gates_MK.reshape(-1)[pairs]
        y_ND = y_ND * g_N[:, None].to(y_ND.dtype)
        out = torch.zeros(M, x_MD.shape[1], dtype=y_ND.dtype, device=x_MD.device)
        return out.index_add(0, torch.div(pairs, K, rounding_mode="floor"), y_ND)

    @staticmethod
    def _compiled_experts(experts, x_RD, local_R, weights, splits) -> torch.Tensor:
        """The local experts inside a compiled graph, where R is an unbacked symbol (the sum of
        the received splits). Two padding rows (expert 0, gate 0, dropped after) make R + 2 >= 2
        provable, so inductor's matmul lowerings, which ask whether a size is 1, need no guard
        on the data; the expert ops take R = 0 rows too, so nothing branches on R."""
        for s in splits:
            torch._check_is_size(s)
        R, D = x_RD.shape
        x_QD = torch.cat([x_RD, x_RD.new_zeros(2, D)])
        ids_Q = torch.cat([local_R, local_R.new_zeros(2)])
        gates_Q1 = torch.cat([torch.ones(R, 1, device=x_RD.device),
                              torch.zeros(2, 1, device=x_RD.device)])
        return experts.run(x_QD, ids_Q[:, None], gates_Q1, weights)[:R]

    # ------------------------------------------------------------------ gradients

    @torch.no_grad()
    def sync_grads(self) -> None:
        """After the update's last backward: expert gradients summed over the dp group and
        divided by W (DDP's average over all processes; module docstring)."""
        from torch.distributed.tensor import DTensor, Shard

        grads = []
        for p in self.params.values():
            if p.grad is None:
                p.grad = DTensor.from_local(torch.zeros_like(p.to_local()), self.ep_mesh,
                                            [Shard(0)], run_check=False, shape=p.shape,
                                            stride=p.stride())
            grads.append(p.grad.to_local())  # under no_grad: the DTensor's own storage
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.W // self.P > 1:
            dist.all_reduce(flat, group=self.dp_group)
        flat.div_(self.W)
        for g, v in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(v.view_as(g))

    @torch.no_grad()
    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ over the whole model: plain (replicated) gradients count
        once, FSDP2's shards (DTensors on the world mesh) are summed over all processes, the
        expert shards over an ep group (their dp replicas are equal: summed over all processes
        and divided by the dp size). One all-reduce."""
        from torch.distributed.tensor import DTensor

        expert = {id(p) for p in self.params.values()}
        params = [p for p in params if p.grad is not None]
        # [FSDP shards, expert shards, replicated]
        sq = torch.zeros(3, dtype=torch.float64, device=params[0].grad.device)
        for p in params:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            slot = 1 if id(p) in expert else 0 if isinstance(p.grad, DTensor) else 2
            sq[slot] += g.detach().double().square().sum()
        part = sq[:2].clone()
        dist.all_reduce(part)
        total = (part[0] + part[1] / (self.W // self.P) + sq[2]).sqrt().float()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for p in params:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.mul_(coef.to(g.dtype))
        return total

    # ------------------------------------------------------------------ single-file checkpoints

    def _shard(self, full: torch.Tensor) -> torch.Tensor:
        """This process's rows of a full tensor, as a Shard(0) DTensor on the ep mesh."""
        from torch.distributed.tensor import DTensor, Shard

        L = full.shape[0] // self.P
        local = full[self.ep_rank * L:(self.ep_rank + 1) * L].clone()
        return DTensor.from_local(local, self.ep_mesh, [Shard(0)], run_check=False,
                                  shape=full.shape, stride=full.stride())

    @torch.no_grad()
    def load_full_state(self, model_state: dict, optimizer_state: dict | None,
                        optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
        """The state dicts of a single-file checkpoint (full tensors) with the expert weights
        and their AdamW moments narrowed to this process's rows (Shard(0) DTensors; a
        checkpoint whose layers held their experts' weights is read under the current names,
        moeify.layers.experts.EXPERT_KEYS)."""
        model_state = upgrade_legacy_keys(self.model, model_state)
        for name in self.params:
            model_state[name] = self._shard(model_state[name])
        if optimizer_state is None or optimizer is None:
            return model_state, optimizer_state
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                                 for p in g["params"])}
        opt = dict(optimizer_state)
        opt["state"] = dict(opt["state"])
        # The kernel flags stay this optimizer's: a one-process run's fused AdamW (which
        # load_state_dict would restore) takes no DTensor.
        opt["param_groups"] = [{**g, **{k: mine[k] for k in ("fused", "foreach") if k in mine}}
                               for g, mine in zip(opt["param_groups"], optimizer.param_groups)]
        for p in self.params.values():
            i = index[id(p)]
            st = opt["state"].get(i, opt["state"].get(str(i)))
            if st is None:
                continue
            opt["state"][i] = {k: (self._shard(v) if torch.is_tensor(v)
                                   and v.shape == p.shape else v) for k, v in st.items()}
        return model_state, opt
