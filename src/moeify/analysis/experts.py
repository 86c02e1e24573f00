"""Expert usage per layer over a sample of data, for every kind of routing in a model.

Shape legend: B streams, T tokens per window, L layers of one kind, X columns (experts; for
SwitchHead head-major, column h·E + e).

The model runs in eval mode over the sample as B contiguous streams (XL memory carried between
windows, as in training and validation); each routed layer's per-batch statistics (the
``LMOutput.stats`` every layer returns, detached) are summed:

    SwitchHead   layers.i.attn.sel_{v,k,o,q}_counts [H, E]: selections per head and expert; the
                 source side (V, K) and the destination side (O, Q) each have one selection
    MoA          layers.i.attn.counts [E]: selected heads
    sigma-MoE, Switch   layers.i.ff.tokens_per_expert [E] (Switch: [E + no-op experts])
    MoD          layers.i.mod.fraction_routed: fraction of tokens the block processed

Shares are per head (SwitchHead) or per layer: a uniform router gives 1/E everywhere. An expert
no token selected in the whole sample is "dead".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from moeify.analysis.plotting import pyplot, save_figure
from moeify.errors import MoeifyError

_STAT = re.compile(r"^layers\.(\d+)\.(.+)$")
MOD_KIND = "MoD fraction routed"


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


def _kind_of(stat: str, layer_cfgs: dict[str, object]) -> tuple[str, str] | None:
    """(kind, group key) of a per-layer statistic name, or None when it is not usage."""
    m = re.match(r"^attn\.sel_([qkvo])_counts$", stat)
    if m:
        p = m.group(1)
        experts = sorted(getattr(layer_cfgs["attention"], "experts", {p}))
        side = ("k", "v") if p in "kv" else ("o", "q")
        names = "/".join(n.upper() for n in experts if n in side)
        return f"SwitchHead {names} experts", "src" if p in "kv" else "dst"
    if stat == "attn.counts":
        return "MoA heads", "moa"
    if stat == "ff.tokens_per_expert":
        name = type(layer_cfgs["feedforward"]).__name__
        return ("Switch experts" if name.startswith("Switch") else "\u03c3-MoE experts"), "ff"
    if stat == "mod.fraction_routed":
        return MOD_KIND, "mod"
    return None


@torch.no_grad()
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
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums: dict[tuple[int, str], torch.Tensor] = {}
    n_windows: dict[tuple[int, str], int] = {}
    memory = None
    try:
        for start in range(0, per_row, T):
            out = model(rows_BN[:, start:start + T].to(device), memory=memory)
            memory = out.memory
            for key, value in out.stats.items():
                m = _STAT.match(key)
                if not m:
                    continue
                k = (int(m.group(1)), m.group(2))
                v = value.detach().to("cpu", torch.float64)
                sums[k] = sums[k] + v if k in sums else v
                n_windows[k] = n_windows.get(k, 0) + 1
    finally:
        model.train(was_training)

    attn_cfgs, ff_cfgs = cfg.attention_layers(), cfg.feedforward_layers()
    tables: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    meta: dict[tuple[str, str], dict] = {}
    for (layer, stat), total in sorted(sums.items()):
        kind = _kind_of(stat, {"attention": attn_cfgs[layer], "feedforward": ff_cfgs[layer]})
        if kind is None:
            continue
        rows = tables.setdefault(kind, {})
        if layer in rows:  # V and K (or O and Q) share one selection: count it once
            continue
        if kind[0] == MOD_KIND:
            total = total / n_windows[(layer, stat)]
        rows[layer] = total.numpy().reshape(1, -1)
        info = meta.setdefault(kind, {"groups": 1, "n_real": None})
        if kind[1] in ("src", "dst"):
            info["groups"] = total.shape[0]
        if kind[1] == "ff" and hasattr(ff_cfgs[layer], "noop_experts"):
            info["n_real"] = ff_cfgs[layer].n_experts
    out_tables = []
    order = {"src": 0, "dst": 1, "moa": 2, "ff": 3, "mod": 4}
    for kind, rows in sorted(tables.items(), key=lambda kv: (order[kv[0][1]], kv[0][0])):
        layers = sorted(rows)
        widths = {rows[i].shape[1] for i in layers}
        if len(widths) != 1:  # differently sized layers of one kind: pad with zeros
            w = max(widths)
            rows = {i: np.pad(r, ((0, 0), (0, w - r.shape[1]))) for i, r in rows.items()}
        counts = np.concatenate([rows[i] for i in layers], 0)
        info = meta[kind]
        X = counts.shape[1]
        if kind[0] == MOD_KIND:
            labels = ["routed"]
        elif info["groups"] > 1:
            E = X // info["groups"]
            labels = [f"h{h}e{e}" for h in range(info["groups"]) for e in range(E)]
        else:
            labels = [str(e) if info["n_real"] is None or e < info["n_real"] else f"no-op {e}"
                      for e in range(X)]
        if kind[0] != MOD_KIND:
            counts = np.rint(counts).astype(np.int64)
        out_tables.append(UsageTable(kind[0], layers, counts, info["groups"], info["n_real"],
                                     labels))
    return out_tables


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
