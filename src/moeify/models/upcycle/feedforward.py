"""Dense MLP -> expert feedforwards: sigma-MoE by splitting the hidden units, Switch by copying.

Dense:     y = W2 · act(W1 · x + b1) + b2                      (W1 [F, D], W2 [D, F])

The dense MLP is the papers' ReLU MLP (DenseFFConfig) or an imported one (MLPConfig: GPT-2's
GELU, tanh approximation, with biases; an MLP without biases gives experts without them). The
experts take the same activation (``SigmaMoEConfig.activation`` / ``SwitchFFConfig.activation``),
so everything stated below holds for every activation. A gated MLP (SwiGLU: Llama, Mistral,
Qwen2) is refused: its experts would need a third matrix W_gate, which neither expert has.

sigma-MoE (arXiv 2310.10837: its experts are slices of one MLP): the F hidden units are
permuted and cut into E experts of G = F / E units; expert e's keys (``w_in``) are its units'
rows of W1, its values (``w_out``) their columns of W2, its bias (``bias_in``) their b1
(``SigmaMoEConfig.bias``), and b2 becomes the layer's ungated output bias (``bias_out``). The
output of an expert is multiplied by its gate sigmoid(s_e), s_e = x · w_router,e; the
conversion doubles the values (1 / sigmoid(0)) and starts the router
near 0, so every gate is about 1/2 and the doubled values cancel it.
    Preserves: with k = E and router_scale = 0 every gate is exactly 1/2 and every unit is
    used, so the layer equals the dense MLP (a permutation of its hidden units): exact.
    With k < E each token keeps k of the E slices: the dropped slices' contribution is lost,
    and the router decides which. ``split=cluster`` (default) groups units whose W1 rows point
    the same way (balanced spherical k-means, as MoEfication, Zhang et al. 2022, clusters the
    first layer's rows), and ``router=keys`` sets router row e to the direction of the mean of
    expert e's W1 rows, so s_e is proportional to the mean pre-activation of the expert's units:
    the k selected slices are those whose units the token excites most on average. The rows have
    norm router_scale · s (s = sqrt(2/L), a fresh router's row norm), keeping s_e small and the
    gates near 1/2.

Switch / top-k softmax (sparse upcycling, Komatsuzaki et al., ICLR 2023): every expert is a
copy of the dense MLP (biases in ``SwitchFFConfig.bias``). Switch multiplies an expert's output
by its router probability p_e (top-1: p_max, not 1), so the conversion multiplies W_out by E / k
and starts the router near 0: every probability is about 1/E and the k kept gates sum to about
k / E, which the factor cancels.
    Preserves: with router_scale = 0 (all probabilities exactly 1/E) and nothing dropped
    (``dropless``, the default, or a capacity no token exceeds) the layer equals the dense MLP:
    exact. The default small random router keeps the gates within a fraction router_scale of
    1/E and breaks the top-k's ties. It does not spread the tokens evenly: its scores are
    dominated by what all tokens share (the LayerNorm bias, the residual stream's mean), so one
    expert can take most of a batch, which capacity routing would drop; hence dropless by
    default. With ``dropless=false`` the balance loss spreads the tokens during training.
    ``noise`` adds N(0, (noise · std(W))²) to each expert's copy; ``reinit`` is
    drop-upcycling (Nakamura et al., ICLR 2025, §3): per expert, a random fraction ``reinit`` of
    the hidden units get their W_in columns, W_out rows and b1 entries redrawn from
    N(mean, std²) of the dense matrix they came from, so the experts diverge from the start.
    Both break exact preservation by design.

Shape legend: D d_model, F dense hidden units, E experts, G = F / E units per sigma-MoE expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeify.layers.common import init_scale
from moeify.layers.feedforward import DenseFeedForward
from moeify.layers.mlp import MLP, GatedMLP
from moeify.layers.sigma_moe import SigmaMoE, SigmaMoEConfig
from moeify.layers.switch_ff import SwitchFeedForward, SwitchFFConfig
from moeify.models.upcycle.common import generator, normal_like, small_router

SPLITS = ("cluster", "contiguous")
GATED_MLP = ("a gated (SwiGLU) MLP's experts would need a third matrix (W_gate), which sigma-MoE "
             "and Switch experts lack")
SIGMA_ROUTERS = ("keys", "random")


def _dense_weights(ff, kind: str) -> tuple:
    """(config, W1 [F, D], b1 [F] | None, W2 [D, F], b2 [D] | None, activation) of a dense
    two-layer MLP: the papers' ReLU MLP or an imported one (layers/mlp.py, e.g. GPT-2's GELU)."""
    if isinstance(ff, GatedMLP):
        raise ValueError(f"{kind}: {GATED_MLP}; leave the feedforward dense")
    if not isinstance(ff, (DenseFeedForward, MLP)):
        raise ValueError(f"{kind}: only a dense two-layer MLP (DenseFFConfig or MLPConfig) "
                         f"converts to experts, got {type(ff).__name__}")
    act = ff.config.activation if isinstance(ff, MLP) else "relu"

    def get(t):
        return None if t is None else t.detach().float()

    return (ff.config, get(ff.w1.weight), get(ff.w1.bias), get(ff.w2.weight), get(ff.w2.bias),
            act)


def balanced_clusters(w_FD: torch.Tensor, n_clusters: int, gen: torch.Generator,
                      iters: int = 8) -> torch.Tensor:
    """A permutation of the F rows such that rows [e·G, (e+1)·G) form cluster e: balanced
    spherical k-means on the row directions (assignment greedy by cosine, G rows per cluster)."""
    F_, G = w_FD.shape[0], w_FD.shape[0] // n_clusters
    x_FD = F.normalize(w_FD, dim=-1)
    cent_ED = x_FD[torch.randperm(F_, generator=gen)[:n_clusters]]
    assign_F = torch.arange(F_) // G
    for _ in range(iters):
        sim_FE = x_FD @ cent_ED.t()
        order = sim_FE.flatten().argsort(descending=True).tolist()
        assign, room, left = [-1] * F_, [G] * n_clusters, F_
        for pair in order:  # not a hot path: at most F · E pairs, once per conversion
            unit, e = divmod(pair, n_clusters)
            if assign[unit] < 0 and room[e]:
                assign[unit], room[e], left = e, room[e] - 1, left - 1
                if not left:
                    break
        assign_F = torch.tensor(assign)
        cent_ED = F.normalize(torch.zeros_like(cent_ED).index_add_(0, assign_F, x_FD), dim=-1)
    return torch.argsort(assign_F, stable=True)


def to_sigma_moe(ff: DenseFeedForward | MLP, *, n_experts: int, k: int | None = None,
                 split: str = "cluster", router: str = "keys", router_scale: float = 0.1,
                 entropy_coef: float = 1e-4, seed: int = 0) -> SigmaMoE:
    """The dense MLP as a sigma-MoE of ``n_experts`` slices, ``k`` (default all) per token.
    See the module docstring for what it preserves."""
    c, w1, b1, w2, b2, act = _dense_weights(ff, "sigma-moe")
    E, k = n_experts, n_experts if k is None else k
    if c.d_ff % E:
        raise ValueError(f"sigma-moe: the dense d_ff={c.d_ff} does not split into E={E} equal "
                         f"experts; choose E dividing {c.d_ff}")
    if split not in SPLITS or router not in SIGMA_ROUTERS:
        raise ValueError(f"sigma-moe: split must be one of {', '.join(SPLITS)} and router one of "
                         f"{', '.join(SIGMA_ROUTERS)}, got split={split!r} router={router!r}")
    if router_scale < 0:
        raise ValueError(f"sigma-moe: router_scale must be >= 0, got {router_scale}")
    G = c.d_ff // E
    cfg = SigmaMoEConfig(d_model=c.d_model, n_experts=E, expert_size=G, k=k,
                         entropy_coef=entropy_coef, n_layers=c.n_layers, bias=b1 is not None,
                         activation=act)
    gen = generator(seed)
    perm_F = balanced_clusters(w1, E, gen) if split == "cluster" else torch.arange(c.d_ff)
    w_in_EDG = w1[perm_F].view(E, G, c.d_model).transpose(1, 2)
    s = init_scale(c.n_layers)
    if router == "keys":
        w_router_ED = F.normalize(w_in_EDG.mean(-1), dim=-1) * (s * router_scale)
    else:
        w_router_ED = small_router((E, c.d_model), s / c.d_model ** 0.5, router_scale, gen)
    moe = SigmaMoE(cfg)
    with torch.no_grad():
        moe.experts.w_in.copy_(w_in_EDG)
        # 1 / sigmoid(0) = 2: the gates start at about 1/2 (module docstring).
        moe.experts.w_out.copy_(2.0 * w2.t()[perm_F].view(E, G, c.d_model))
        moe.w_router.copy_(w_router_ED)
        if b1 is not None:
            moe.experts.bias_in.copy_(b1[perm_F].view(E, G))
            moe.bias_out.copy_(b2)
    return moe


def to_switch(ff: DenseFeedForward | MLP, *, n_experts: int, k: int = 1, noise: float = 0.0,
              reinit: float = 0.0, router_scale: float = 0.01, capacity_factor: float = 1.25,
              eval_capacity_factor: float = 2.0, dropless: bool = True,
              seed: int = 0) -> SwitchFeedForward:
    """The dense MLP copied into ``n_experts`` Switch experts (top-``k`` softmax routing).
    See the module docstring for what it preserves."""
    c, w1, b1, w2, b2, act = _dense_weights(ff, "switch")
    E = n_experts
    if not 0.0 <= reinit <= 1.0 or noise < 0:
        raise ValueError(f"switch: reinit is a fraction in [0, 1] and noise >= 0, got "
                         f"reinit={reinit} noise={noise}")
    if router_scale < 0:
        raise ValueError(f"switch: router_scale must be >= 0, got {router_scale}")
    cfg = SwitchFFConfig(d_model=c.d_model, d_ff=c.d_ff, n_experts=E, k=k,
                         capacity_factor=capacity_factor,
                         eval_capacity_factor=eval_capacity_factor, dropless=dropless,
                         bias=b1 is not None, activation=act)
    gen = generator(seed)
    w_in_EDF = w1.t().expand(E, -1, -1).clone()
    w_out_EFD = w2.t().expand(E, -1, -1).clone()
    b_in_EF = None if b1 is None else b1.expand(E, -1).clone()
    if noise > 0:
        for w, src in ((w_in_EDF, w1), (w_out_EFD, w2)):
            w += normal_like(w, noise * src.std().item(), gen)
    n_new = round(reinit * c.d_ff)
    for e in range(E if n_new else 0):  # drop-upcycling: redraw n_new units per expert
        idx = torch.randperm(c.d_ff, generator=gen)[:n_new]
        w_in_EDF[e][:, idx] = normal_like(w_in_EDF[e][:, idx], w1.std().item(), gen,
                                          w1.mean().item())
        w_out_EFD[e][idx] = normal_like(w_out_EFD[e][idx], w2.std().item(), gen,
                                        w2.mean().item())
        if b_in_EF is not None:
            b_in_EF[e][idx] = normal_like(b_in_EF[e][idx], b1.std().item(), gen,
                                          b1.mean().item())
    moe = SwitchFeedForward(cfg)
    with torch.no_grad():
        moe.experts.w_in.copy_(w_in_EDF)
        # Gates start at 1/E each, k of them: E / k restores the dense output (docstring).
        moe.experts.w_out.copy_(w_out_EFD * (E / k))
        moe.w_router.copy_(small_router(tuple(moe.w_router.shape),
                                        (0.1 / c.d_model) ** 0.5, router_scale, gen))
        if b_in_EF is not None:
            moe.experts.bias_in.copy_(b_in_EF)
            moe.bias_out.copy_(b2)
    return moe
