"""Expert usage per layer over a sample of data, for every kind of routing in a model.

Shape legend: B streams, T tokens per window, L layers of one kind, X columns (experts; for
SwitchHead head-major, column h·E + e).

The model runs in eval mode over the sample as B contiguous streams (XL memory carried between
windows, as in training and validation); the counts of each routing record of every layer
(``LMOutput.routing``, moeify.layers.common.RoutingStats) are summed per kind and layer:

    SwitchHead   [H, E] selections per head and expert; the source side (V, K) and the
                 destination side (O, Q) each have one selection
    MoA          [1, E] selected heads
    MoH          [1, h - h_s] selected routed heads (the shared heads are always active)
    sigma-MoE, Switch   [1, E] (Switch: [1, E + no-op experts])
    MoD          [1, 2] skipped and routed tokens: the table holds the fraction routed

Shares are per head (SwitchHead) or per layer: a uniform router gives 1/E everywhere. An expert
no token selected in the whole sample is "dead".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from moeify.analysis.plotting import pyplot, save_figure
from moeify.errors import MoeifyError

from moeify.layers.common import ROUTING_KINDS, RoutingStats

MOD_KIND = ROUTING_KINDS["mod"]


@dataclass
class UsageTable:
    """Summed selections of one routing kind: rows are layers, columns experts."""

    kind: str
    layers: list[int]
    counts: np.ndarray  # [L, X] (MoD: [L, 1] fraction routed)
    groups: int = 1  # column groups normalised separately (SwitchHead heads)
    n_real: int | None = None  # columns past n_real are no-op experts (Switch)
    column_labels: list[str] = field(default_factory=list)

    @property
    def shares(self) -> np.ndarray:
        if self.kind == MOD_KIND:
            return self.counts.astype(np.float64)
        L, X = self.counts.shape
        c = self.counts.reshape(L, self.groups, X // self.groups).astype(np.float64)
        return (c / np.maximum(c.sum(-1, keepdims=True), 1.0)).reshape(L, X)

    @property
    def dead(self) -> np.ndarray:
        if self.kind == MOD_KIND:
            return np.zeros_like(self.counts, dtype=bool)
        dead = self.counts == 0
        if self.n_real is not None:
            dead[:, self.n_real:] = False
        return dead

    def to_dict(self) -> dict:
        return {"kind": self.kind, "layers": self.layers, "groups": self.groups,
                "counts": self.counts.tolist(), "shares": np.round(self.shares, 5).tolist(),
                "dead": int(self.dead.sum())}


_ORDER = {("switchhead", "src"): 0, ("switchhead", "dst"): 1, ("moa", ""): 2, ("moh", ""): 2,
          ("sigma_moe", ""): 3, ("switch", ""): 3, ("mod", ""): 4, ("mor", ""): 5}


def _group(r: RoutingStats) -> tuple[int, str]:
    """Sort key and table of a routing record: SwitchHead's source side before its destination
    side, then MoA and MoH, the feedforwards, depth routing."""
    side = ("src" if set(r.serves) & {"k", "v"} else "dst") if r.kind == "switchhead" else ""
    return _ORDER[(r.kind, side)], r.label


@torch.no_grad()
def _summed_routing(model: nn.Module, rows_BN: torch.Tensor, T: int
                    ) -> dict[tuple[int, str], dict[int, RoutingStats]]:
    """Run the model over the windows of ``rows_BN`` and sum every routing record's counts:
    {(order, label): {layer: record with the summed counts}}."""
    device = next(model.parameters()).device
    sums: dict[tuple[int, str], dict[int, RoutingStats]] = {}
    memory = None
    for start in range(0, rows_BN.shape[1], T):
        out = model(rows_BN[:, start:start + T].to(device), memory=memory)
        memory = out.memory
        for r in out.routing.values():
            rows = sums.setdefault(_group(r), {})
            prev = rows.get(r.layer)
            counts = r.counts.detach().to("cpu", torch.int64)
            rows[r.layer] = (RoutingStats(r.kind, counts, None, r.serves, r.n_real, r.layer)
                             if prev is None else
                             RoutingStats(r.kind, prev.counts + counts, None, r.serves,
                                          r.n_real, r.layer))
    return sums


def _table(label: str, rows: dict[int, RoutingStats]) -> UsageTable:
    layers = sorted(rows)
    first = rows[layers[0]]
    if first.kind == "mod":
        frac = [[rows[i].counts[0, 1].item() / max(rows[i].counts.sum().item(), 1)]
                for i in layers]
        return UsageTable(label, layers, np.array(frac, dtype=np.float64), 1, None, ["routed"])
    G = first.counts.shape[0]
    X = max(rows[i].counts.numel() for i in layers)
    # differently sized layers of one kind: pad with zeros
    counts = np.stack([np.pad(rows[i].counts.reshape(-1).numpy(),
                              (0, X - rows[i].counts.numel())) for i in layers])
    if G > 1:
        labels = [f"h{h}e{e}" for h in range(G) for e in range(X // G)]
    else:
        labels = [str(e) if first.n_real is None or e < first.n_real else f"no-op {e}"
                  for e in range(X)]
    return UsageTable(label, layers, counts.astype(np.int64), G, first.n_real, labels)


def expert_usage(model: nn.Module, tokens, *, batch_size: int = 4, seq_len: int | None = None,
                 max_tokens: int = 16384) -> list[UsageTable]:
    """Run ``model`` over the first ``max_tokens`` of the 1-D token array ``tokens`` and sum every
    routed layer's selections. Returns one table per routing kind (none for a dense model)."""
    cfg = model.config
    T = seq_len or cfg.context_length
    tok = torch.as_tensor(np.asarray(tokens[: max_tokens], dtype=np.int64))
    per_row = tok.numel() // batch_size
    if per_row < 1:
        raise ValueError(f"the sample ({tok.numel()} tokens) is smaller than the batch "
                         f"({batch_size}); give more data or a smaller batch")
    rows_BN = tok[: per_row * batch_size].view(batch_size, per_row)
    was_training = model.training
    model.eval()
    try:
        sums = _summed_routing(model, rows_BN, T)
    finally:
        model.train(was_training)
    return [_table(label, rows) for (_, label), rows in sorted(sums.items())]


def panel_titles(tables: list[UsageTable]) -> list[str]:
    return [t.kind for t in tables]


def plot_experts(tables: list[UsageTable], out: str | Path, *, title: str | None = None) -> Path:
    """One heatmap per routing kind (layer x expert share, dead experts crossed out); MoD as the
    fraction of tokens routed per layer."""
    if not tables:
        raise MoeifyError("the model has no routed layers (no experts, no depth routing): "
                          "there is no expert usage to plot")
    plt = pyplot()
    n = len(tables)
    widths = [max(3.0, 0.28 * t.counts.shape[1] + 1.8) if t.kind != MOD_KIND else 3.5
              for t in tables]
    height = max(2.6, 0.35 * max(len(t.layers) for t in tables) + 1.6)
    fig, axes = plt.subplots(1, n, figsize=(sum(widths) + 1.0, height), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    for ax, t in zip(axes[0], tables):
        if t.kind == MOD_KIND:
            frac = t.counts[:, 0]
            ax.barh(range(len(t.layers)), frac, color="tab:blue")
            ax.set_yticks(range(len(t.layers)))
            ax.set_yticklabels([f"layer {i}" for i in t.layers], fontsize=7)
            ax.set_xlim(0, 1)
            ax.invert_yaxis()
            ax.set_xlabel("fraction of tokens routed through the block", fontsize=7)
            ax.set_title(t.kind, fontsize=9)
            continue
        shares, dead = t.shares, t.dead
        E = t.counts.shape[1] // t.groups
        im = ax.imshow(shares, cmap="magma", vmin=0.0, vmax=max(float(shares.max()), 1e-9),
                       aspect="auto", interpolation="nearest")
        ys, xs = np.nonzero(dead)
        ax.scatter(xs, ys, marker="x", color="tab:cyan", s=40, linewidths=1.5,
                   label="dead (never selected)")
        for g in range(1, t.groups):
            ax.axvline(g * E - 0.5, color="white", linewidth=1.5)
        ax.set_yticks(range(len(t.layers)))
        ax.set_yticklabels([f"layer {i}" for i in t.layers], fontsize=7)
        ax.set_xticks(range(len(t.column_labels)))
        ax.set_xticklabels(t.column_labels, fontsize=6, rotation=90)
        per = "head" if t.groups > 1 else "layer"
        ax.set_title(f"{t.kind}\nshare per {per} (uniform {1 / E:.3g}), "
                     f"{int(dead.sum())} dead", fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
        if dead.any():
            ax.legend(loc="upper right", fontsize=6, framealpha=0.6)
    fig.suptitle(title or "expert usage", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, out, panel_titles(tables))


def format_usage(tables: list[UsageTable]) -> str:
    """A short text summary: per kind and layer, the most and least used expert and dead ones."""
    lines = []
    for t in tables:
        lines.append(f"{t.kind}:")
        for row, layer in enumerate(t.layers):
            if t.kind == MOD_KIND:
                lines.append(f"  layer {layer}: {t.counts[row, 0]:.3f} of tokens routed")
                continue
            s = t.shares[row]
            lines.append(f"  layer {layer}: share min {s.min():.3f} max {s.max():.3f}, "
                         f"{int(t.dead[row].sum())} dead")
    return "\n".join(lines)
