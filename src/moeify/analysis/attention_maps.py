"""Attention maps with expert selections (the SwitchHead paper's Figure 2) and per-head entropy.

Shape legend
    B batch (1 here)   T destination (query) tokens   S source (key) tokens
    H attention matrices of the layer (heads; MoA: its k selected-head slots)
    E experts per head

The maps come from each attention layer's ``inspect`` method, which runs the layer's own routing,
projections and attention core and returns the probabilities and (SwitchHead) the gates of the
selected experts. The layer's inputs are captured with a forward pre-hook during an ordinary
forward pass of the model, so they are exactly what the layer sees in training (layer norm
applied, positions and masks as the block passes them).

Entropy: per head, the mean over query rows of the Shannon entropy (bits) of the attention
distribution, and the same divided by log2 of the number of keys the (causal) query may see
(1 = uniform over everything visible, 0 = all mass on one key); rows that see a single key are
left out of the normalised mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from moeify.analysis.plotting import pyplot, save_figure
from moeify.layers.moa import MoAAttention
from moeify.layers.moh import MoHAttention
from moeify.layers.switchhead import SwitchHeadAttention
from moeify.models.lm import attention_of


@dataclass
class AttentionMaps:
    """One layer's attention for one sequence (numpy, float)."""

    kind: str  # "switchhead", "moa", "moh" or "dense"
    layer: int
    dst_tokens: list[str]
    src_tokens: list[str]
    probs_HTS: np.ndarray
    sel_dst_THE: np.ndarray | None = None  # gates of the destination-side (O/Q) experts; MoH:
    # each head's gate g_i per token, E = 1
    sel_src_SHE: np.ndarray | None = None  # gates of the source-side (V/K) experts
    entropy_H: np.ndarray = field(default=None)
    norm_entropy_H: np.ndarray = field(default=None)

    def __post_init__(self) -> None:
        if self.entropy_H is None:
            self.entropy_H, self.norm_entropy_H = head_entropy(self.probs_HTS)

    @property
    def n_heads(self) -> int:
        return self.probs_HTS.shape[0]

    def to_dict(self) -> dict:
        return {"kind": self.kind, "layer": self.layer, "heads": self.n_heads,
                "entropy_bits": [round(float(x), 4) for x in self.entropy_H],
                "normalised_entropy": [round(float(x), 4) for x in self.norm_entropy_H]}


def head_entropy(probs_HTS: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean entropy in bits, mean entropy / log2(visible keys)) per head; see module doc.

    Queries are causal with the default positions: query i sees the first S - T + i + 1 keys
    (counted from the mask, not from the support, since sharp rows underflow to exact zeros)."""
    p = np.asarray(probs_HTS, dtype=np.float64)
    _, T, S = p.shape
    plogp = np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0)), 0.0)
    ent_HT = -plogp.sum(-1)
    visible_T = np.clip(np.arange(T) + S - T + 1, 0, S)
    live_HT = p.sum(-1) > 0  # rows with no visible key output zeros (ops/attention.py)
    ent = np.array([ent_HT[h][live_HT[h]].mean() if live_HT[h].any() else 0.0
                    for h in range(p.shape[0])])
    multi_HT = live_HT & (visible_T > 1)[None]
    norm_HT = ent_HT / np.log2(np.maximum(visible_T, 2))[None]
    norm = np.array([norm_HT[h][multi_HT[h]].mean() if multi_HT[h].any() else 0.0
                     for h in range(p.shape[0])])
    return ent, norm


def layer_kind(attn: nn.Module) -> str:
    if isinstance(attn, SwitchHeadAttention):
        return "switchhead"
    if isinstance(attn, MoAAttention):
        return "moa"
    if isinstance(attn, MoHAttention):
        return "moh"
    return "dense"


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """One printable label per token (whitespace made visible)."""
    out = []
    for i in ids:
        s = tokenizer.decode([i]) if tokenizer is not None else str(i)
        s = s.replace(" ", "\u00b7").replace("\n", "\\n").replace("\t", "\\t")
        out.append(s if s else "\u2205")
    return out


@torch.no_grad()
def compute_attention_maps(model: nn.Module, ids_T, *, layer: int = 0,
                           tokenizer=None) -> AttentionMaps:
    """Run ``model`` on one token sequence (no memory) and inspect attention layer ``layer``."""
    blocks = model.blocks
    if not -len(blocks) <= layer < len(blocks):
        raise ValueError(f"layer {layer} does not exist: the model has {len(blocks)} layers "
                         f"(0-{len(blocks) - 1})")
    layer = layer % len(blocks)
    attn = attention_of(blocks[layer])
    if not hasattr(attn, "inspect"):
        raise ValueError(f"{type(attn).__name__} has no inspect() method: its attention maps "
                         "cannot be drawn")
    ids_1T = torch.as_tensor(ids_T, dtype=torch.long).reshape(1, -1)
    if ids_1T.shape[1] < 2:
        raise ValueError("give a text of at least two tokens")
    captured: dict = {}

    def hook(_module, args, kwargs):
        captured.setdefault("args", args)
        captured.setdefault("kwargs", dict(kwargs))

    handle = attn.register_forward_pre_hook(hook, with_kwargs=True)
    was_training = model.training
    model.eval()
    try:
        model(ids_1T.to(next(model.parameters()).device))
    finally:
        handle.remove()
        model.train(was_training)
    if "args" not in captured:
        raise ValueError(f"layer {layer}'s attention was not called (a depth router skipped "
                         "every token?)")
    args, kwargs = captured["args"], captured["kwargs"]
    kwargs.pop("cache", None)
    q_BTD = args[0]
    kv_BSD = args[1] if len(args) > 1 else kwargs.pop("kv_BSD", None)
    out = attn.inspect(q_BTD, kv_BSD, **kwargs)

    labels = token_labels(tokenizer, ids_1T[0].tolist())
    T = q_BTD.shape[1]
    S = T if kv_BSD is None else kv_BSD.shape[1]
    # A depth-routed block sees a subset of the tokens, named by its explicit positions.
    pos_q, pos_k = kwargs.get("pos_q"), kwargs.get("pos_k")
    dst = [labels[i] for i in pos_q[0].tolist()] if pos_q is not None else labels[-T:]
    src = [labels[i] for i in pos_k[0].tolist()] if pos_k is not None else (
        dst if S == T else [f"m{i}" for i in range(S - T)] + dst)

    def first(key):
        v = out.get(key)
        return None if v is None else v[0].float().cpu().numpy()

    return AttentionMaps(kind=layer_kind(attn), layer=layer, dst_tokens=dst, src_tokens=src,
                         probs_HTS=first("probs_BHTS"), sel_dst_THE=first("sel_dst_BTHE"),
                         sel_src_SHE=first("sel_src_BSHE"))


# ---------------------------------------------------------------------------------------------


def _tick_labels(ax, labels: list[str], axis: str, max_labels: int = 48) -> None:
    n = len(labels)
    step = max(1, -(-n // max_labels))
    pos = list(range(0, n, step))
    size = 7 if n <= 24 else 5
    if axis == "x":
        ax.set_xticks(pos)
        ax.set_xticklabels([labels[i] for i in pos], fontsize=size, rotation=90)
    else:
        ax.set_yticks(pos)
        ax.set_yticklabels([labels[i] for i in pos], fontsize=size)


def panel_titles(maps: AttentionMaps) -> list[str]:
    heads = "slot" if maps.kind == "moa" else "head"
    titles = [f"layer {maps.layer} {heads} {h}: {maps.entropy_H[h]:.2f} bits "
              f"({maps.norm_entropy_H[h]:.2f} of uniform)" for h in range(maps.n_heads)]
    return titles + [f"layer {maps.layer} max over {heads}s"]


def plot_attention(maps: AttentionMaps, out: str | Path, *, title: str | None = None) -> Path:
    """One panel per head plus the max over heads. SwitchHead panels carry the destination-side
    expert gates as a strip left of the rows and the source-side gates as a strip under the
    columns (one strip column / row per expert of that head; white = not selected); MoH panels
    carry the head's gate at each query token left of the rows (white = head not active)."""
    plt = pyplot()
    H, T, S = maps.probs_HTS.shape
    n_panels = H + 1
    ncols = min(n_panels, 4)
    nrows = -(-n_panels // ncols)
    E = 0
    for sel in (maps.sel_dst_THE, maps.sel_src_SHE):
        if sel is not None:
            E = sel.shape[-1]
    panel_in = 3.2 + 0.02 * max(T, S)
    fig = plt.figure(figsize=(ncols * panel_in + 0.6, nrows * (panel_in + 0.5) + 0.6))
    outer = fig.add_gridspec(nrows, ncols, wspace=0.35, hspace=0.45)
    titles = panel_titles(maps)
    strips = maps.kind in ("switchhead", "moh")
    strip_frac = max(0.06, E / max(T, S, 1) * 1.5) if strips and E else 0.0
    image = None
    for p in range(n_panels):
        image = _panel(fig, outer[p // ncols, p % ncols], maps, p, titles[p],
                       strip_frac if strips else None)
    if image is not None:
        fig.colorbar(image, ax=fig.axes, shrink=0.6, label="attention probability")
    kind = {"switchhead": "SwitchHead", "moa": "MoA", "moh": "MoH", "dense": "dense"}[maps.kind]
    fig.suptitle(title or f"{kind} attention, layer {maps.layer}", fontsize=10)
    return save_figure(fig, out, titles)


def _panel(fig, cell, maps: AttentionMaps, p: int, title: str, strip_frac: float | None):
    """Panel ``p`` (head p, or the max over heads when p = H) in grid cell ``cell``, with the
    gate strips when ``strip_frac`` is given; returns its image."""
    is_max = p == maps.probs_HTS.shape[0]
    probs = maps.probs_HTS.max(0) if is_max else maps.probs_HTS[p]
    if strip_frac is not None:
        g = cell.subgridspec(2, 2, width_ratios=[strip_frac, 1], height_ratios=[1, strip_frac],
                             wspace=0.02, hspace=0.02)
        ax = fig.add_subplot(g[0, 1])
    else:
        ax = fig.add_subplot(cell)
    image = ax.imshow(probs, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto",
                      interpolation="nearest")
    ax.set_title(title, fontsize=8, pad=4)
    if strip_frac is None:
        _tick_labels(ax, maps.dst_tokens, "y")
        _tick_labels(ax, maps.src_tokens, "x")
        return image
    ax.set_xticks([])
    ax.set_yticks([])
    dst = None if is_max or maps.sel_dst_THE is None else maps.sel_dst_THE[:, p, :]
    src = None if is_max or maps.sel_src_SHE is None else maps.sel_src_SHE[:, p, :]
    if dst is not None:
        _dst_strip(fig.add_subplot(g[0, 0], sharey=ax), dst, maps)
    else:
        _tick_labels(ax, maps.dst_tokens, "y")
    if src is not None:
        _src_strip(fig.add_subplot(g[1, 1], sharex=ax), src, maps)
    else:
        _tick_labels(ax, maps.src_tokens, "x")
    return image


def _dst_strip(ax_d, dst, maps: AttentionMaps) -> None:
    """The destination-side gates [T, E] left of a panel's rows."""
    # MoH's gates reach 2 and more (the authors' scaled gates): its own range
    top = max(1.0, float(np.nanmax(dst))) if maps.kind == "moh" else 1
    ax_d.imshow(np.where(dst > 0, dst, np.nan), cmap="Oranges", vmin=0, vmax=top,
                aspect="auto", interpolation="nearest")
    ax_d.set_xticks(range(dst.shape[1]))
    ax_d.set_xticklabels([str(e) for e in range(dst.shape[1])], fontsize=5)
    _tick_labels(ax_d, maps.dst_tokens, "y")
    ax_d.set_xlabel("gate" if maps.kind == "moh" else "O expert", fontsize=6)


def _src_strip(ax_s, src, maps: AttentionMaps) -> None:
    """The source-side gates [S, E] under a panel's columns."""
    ax_s.imshow(np.where(src.T > 0, src.T, np.nan), cmap="Purples", vmin=0, vmax=1,
                aspect="auto", interpolation="nearest")
    ax_s.set_yticks(range(src.shape[1]))
    ax_s.set_yticklabels([str(e) for e in range(src.shape[1])], fontsize=5)
    ax_s.yaxis.set_ticks_position("right")
    _tick_labels(ax_s, maps.src_tokens, "x")
    ax_s.set_ylabel("V expert", fontsize=6)
    ax_s.yaxis.set_label_position("right")


def format_entropy(maps: AttentionMaps) -> str:
    """The per-head entropy as a small text table (printed beside the plot)."""
    heads = "slot" if maps.kind == "moa" else "head"
    lines = [f"layer {maps.layer} attention entropy ({maps.kind}, {maps.probs_HTS.shape[1]} "
             f"queries):", f"  {heads:>5} {'bits':>7} {'of uniform':>11}"]
    for h in range(maps.n_heads):
        lines.append(f"  {h:>5} {maps.entropy_H[h]:>7.3f} {maps.norm_entropy_H[h]:>11.3f}")
    return "\n".join(lines)
