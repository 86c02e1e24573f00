"""Plots of real (tiny) trained runs, and the attention layers' inspect() they are drawn from.

inspect() is checked against an independent einsum transcription of each layer's equations
(SwitchHead Eq. 7-10, MoA, dense multi-head): its probabilities and gates must reproduce the
layer's forward output. The plots are rendered through the CLI from runs trained for a few
steps; each PNG is checked for its panels (stored in its metadata) and for not being blank."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

from moeify.analysis.attention_maps import head_entropy
from moeify.analysis.plotting import read_panels
from moeify.cli.main import main
from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.moa import MoAConfig
from moeify.layers.switchhead import SwitchHeadConfig

D, H, C, E, K = 16, 2, 8, 4, 2


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, D, generator=g, dtype=torch.float64)
    mem = torch.randn(2, 3, D, generator=g, dtype=torch.float64)
    return x, torch.cat([mem, x], 1)


def _check_probs(p_BHTS, T, S):
    assert torch.allclose(p_BHTS.sum(-1), torch.ones_like(p_BHTS[..., 0]))
    i = torch.arange(T)[:, None] + (S - T)
    future = torch.arange(S)[None, :] > i  # causal: query i sits at S - T + i
    assert (p_BHTS[..., future] == 0).all() and (p_BHTS[..., ~future] > 0).all()


@pytest.mark.parametrize("pos", ["xl", "rope", "none"])
def test_switchhead_inspect_reproduces_forward(pos):
    torch.manual_seed(1)
    layer = SwitchHeadConfig(d_model=D, n_heads=H, d_head=C, n_experts=E, k=K,
                             pos=pos).build().double()
    x, kv = _inputs()
    y, _ = layer(x, kv)
    r = layer.inspect(x, kv)
    p, g_src, g_dst = r["probs_BHTS"], r["sel_src_BSHE"].double(), r["sel_dst_BTHE"].double()
    _check_probs(p, 5, 8)
    # Eq. 7-8 by hand: sigmoid scores, top-k per head, raw gate values, zero elsewhere.
    for g, inp, w in ((g_src, kv, layer.w_router_src), (g_dst, x, layer.w_router_dst)):
        s = torch.sigmoid(inp @ w.t()).view(*inp.shape[:2], H, E)
        kth = s.topk(K, -1).values[..., -1:]
        assert torch.allclose(g, torch.where(s >= kth, s, torch.zeros_like(s)), atol=1e-6)
    # Eq. 9-10: V as gated expert sums, heads summed through gated O experts.
    v = torch.einsum("bshe,bsd,hedc->bhsc", g_src, kv, layer.w_v.view(H, E, D, C))
    y_ref = torch.einsum("bthe,bhtc,hecd->btd", g_dst, p @ v, layer.w_o.view(H, E, C, D))
    assert torch.allclose(y, y_ref, atol=1e-5)  # gates pass through float32 routing


@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_dense_and_moa_inspect_reproduce_forward(pos):
    torch.manual_seed(2)
    x, kv = _inputs(1)
    dense = DenseAttentionConfig(d_model=D, n_heads=H, d_head=C, pos=pos).build().double()
    y, _ = dense(x, kv)
    p = dense.inspect(x, kv)["probs_BHTS"]
    _check_probs(p, 5, 8)
    v = (kv @ dense.w_v).view(2, 8, H, C).transpose(1, 2)
    assert torch.allclose(y, (p @ v).transpose(1, 2).reshape(2, 5, H * C) @ dense.w_o)

    moa = MoAConfig(d_model=D, d_head=C, n_experts=E, k=K, pos=pos).build().double()
    torch.nn.init.normal_(moa.w_router)  # a zero router would tie every expert
    y, _ = moa(x, kv)
    r = moa.inspect(x, kv)
    p, heads, gates = r["probs_BHTS"], r["heads_BTK"], r["sel_dst_BTE"].double()
    _check_probs(p, 5, 8)
    probs = torch.softmax((x @ moa.w_router.t()).float(), -1).double()
    assert torch.equal(heads.sort(-1).values, probs.topk(K, -1).indices.sort(-1).values)
    o = torch.einsum("bkts,bsc->btkc", p, kv @ moa.w_v)
    y_ref = torch.einsum("btk,btkc,btkcd->btd", gates.gather(-1, heads), o, moa.w_o[heads])
    assert torch.allclose(y, y_ref, atol=1e-6)


def test_head_entropy_by_hand():
    # Causal rows: query i sees keys 0..i (T = S = 3).
    p = np.zeros((2, 3, 3))
    p[0] = [[1, 0, 0], [0.5, 0.5, 0], [1 / 3] * 3]  # 0, 1, log2(3) bits: uniform rows
    p[1] = [[1, 0, 0], [1, 0, 0], [0.5, 0, 0.5]]  # 0, 0, 1 bits
    ent, norm = head_entropy(p)
    assert ent == pytest.approx([(1 + math.log2(3)) / 3, 1 / 3])
    # Normalised over the rows that see more than one key (rows 1 and 2).
    assert norm == pytest.approx([1.0, (0 + 1 / math.log2(3)) / 2])


# ------------------------------------------------------------------------------- tiny runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny runs trained for a few steps on a small local text, one thread (fast under load)."""
    from moeify.train.config import TrainConfig
    from moeify.train.trainer import train

    root = tmp_path_factory.mktemp("runs")
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEIFY_CACHE_DIR", str(root / "cache"))
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat while dogs ran far from home and birds sang".split()
    text = "\n".join(" ".join(rng.choice(words, 10)) for _ in range(300))
    (root / "corpus.txt").write_text(text)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for preset, extra in (("tiny-switchall", ()), ("tiny-dense", ()), ("tiny-moa", ()),
                              ("tiny-mod", ("model.context_length=32",))):
            cfg = TrainConfig(preset=preset, data=str(root / "corpus.txt"), steps=3,
                              tokenizer="byte", batch_size=2, eval_every=2, eval_tokens=256,
                              log_every=1, warmup_steps=0).with_overrides(
                ["model.d_model=32", "model.n_layers=2", "model.context_length=16", *extra])
            train(cfg, root / preset, quiet=True)
            out[preset] = root / preset
        yield out
    finally:
        torch.set_num_threads(threads)
        mp.undo()


def _png_ok(path, panels):
    from PIL import Image

    assert path.is_file()
    assert read_panels(path) == panels
    with Image.open(path) as im:
        a = np.asarray(im.convert("L"), dtype=np.float64)
    assert a.shape[0] > 200 and a.shape[1] > 300 and a.std() > 10  # a real picture


@pytest.mark.parametrize("preset,heads,word", [("tiny-switchall", 2, "head"),
                                               ("tiny-dense", 4, "head"),
                                               ("tiny-moa", 2, "slot")])
def test_plot_attention(runs, tmp_path, capsys, preset, heads, word):
    out = tmp_path / "att.png"
    assert main(["plot", "attention", "--run", str(runs[preset]), "--text",
                 "the cat sat on a mat", "--layer", "1", "--out", str(out)]) == 0
    panels = read_panels(out)
    assert len(panels) == heads + 1 and panels[-1] == f"layer 1 max over {word}s"
    assert all(p.startswith(f"layer 1 {word} {h}:") for h, p in enumerate(panels[:-1]))
    _png_ok(out, panels)
    printed = capsys.readouterr().out
    assert "entropy" in printed and printed.count("\n") >= heads + 2
    # The printed entropies are those of the maps: at most log2(number of keys).
    assert main(["plot", "attention", "--run", str(runs[preset]), "--text",
                 "the cat sat on a mat", "--out", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["entropy_bits"]) == heads
    assert all(0 < e <= math.log2(20) for e in info["entropy_bits"])


def test_plot_experts(runs, tmp_path, capsys):
    out = tmp_path / "experts.png"
    assert main(["plot", "experts", "--run", str(runs["tiny-switchall"]), "--tokens", "256",
                 "--batch-size", "2", "--out", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    kinds = [t["kind"] for t in info["tables"]]
    assert kinds == ["SwitchHead V experts", "SwitchHead O experts", "\u03c3-MoE experts"]
    _png_ok(out, kinds)
    # 2 streams x 128 tokens, 8 windows of 16 with XL memory: every token picks k=2 experts per
    # head (tiny SwitchHead: H=2, E=4) for O and k=2 of the 8 sigma-MoE experts; the V selection
    # runs over the source, memory included (16 tokens, then 32 per window).
    v, o, ff = (np.array(t["counts"]) for t in info["tables"])
    assert v.shape == (2, 8) and o.shape == (2, 8) and ff.shape == (2, 8)
    assert (v.reshape(2, 2, 4).sum(-1) == 2 * 2 * (16 + 7 * 32)).all()
    assert (o.reshape(2, 2, 4).sum(-1) == 2 * 256).all()
    assert (ff.sum(-1) == 2 * 256).all()

    out2 = tmp_path / "mod.png"
    assert main(["plot", "experts", "--run", str(runs["tiny-mod"]), "--tokens", "256",
                 "--batch-size", "2", "--out", str(out2), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [t["kind"] for t in info["tables"]] == ["MoD fraction routed"]
    assert info["tables"][0]["layers"] == [1]  # depth routing on every other block
    assert info["tables"][0]["counts"][0][0] == pytest.approx(0.125)  # capacity 0.125
    _png_ok(out2, ["MoD fraction routed"])

    # A dense model has nothing to show: a one-line error, exit code 2.
    assert main(["plot", "experts", "--run", str(runs["tiny-dense"]), "--tokens", "256",
                 "--out", str(tmp_path / "none.png")]) == 2
    assert "no routed layers" in capsys.readouterr().err


def test_plot_curves(runs, tmp_path, capsys):
    out = tmp_path / "curves.png"
    dirs = [str(runs["tiny-switchall"]), str(runs["tiny-dense"])]
    assert main(["plot", "curves", *dirs, "--labels", "sa,dense", "--out", str(out)]) == 0
    panels = read_panels(out)
    assert panels == ["training bpc vs tokens", "validation bpc vs tokens",
                      "training bpc vs training time", "validation bpc vs training time"]
    _png_ok(out, panels)
    printed = capsys.readouterr().out
    # The final validation printed is the last "valid" record of each metrics file.
    for label, d in zip(("sa", "dense"), dirs):
        recs = [json.loads(ln) for ln in open(f"{d}/metrics.jsonl")]
        last = [r for r in recs if r["kind"] == "valid"][-1]["bpc"]
        assert f"{label}: final validation bpc {last:.4f}" in printed


def test_curves_time_is_reconstructed_from_throughput():
    from moeify.analysis.curves import curve_from_records

    recs = [{"kind": "train", "step": 10, "tokens": 100, "bpc": 3.0, "tokens_per_s": 50},
            {"kind": "valid", "step": 10, "tokens": 999, "bpc": 2.9, "seconds": 100},
            {"kind": "train", "step": 20, "tokens": 200, "bpc": 2.5, "tokens_per_s": 25}]
    c = curve_from_records(recs, "x")
    assert c.train_time == [2.0, 6.0] and c.train_tokens == [100, 200]
    assert c.valid_tokens == [100] and c.valid_time == [2.0] and c.valid_value == [2.9]


def test_bad_input_and_missing_matplotlib(runs, tmp_path, capsys, monkeypatch):
    assert main(["plot", "attention", "--run", str(tmp_path / "nope"), "--text", "ab",
                 "--out", str(tmp_path / "a.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["plot", "attention", "--run", str(runs["tiny-dense"]), "--text", "ab",
                 "--layer", "7", "--out", str(tmp_path / "a.png")]) == 2
    assert "layer 7 does not exist" in capsys.readouterr().err
    assert main(["plot", "curves", str(runs["tiny-dense"]), "--out",
                 str(tmp_path / "a.jpg")]) == 2
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", "curves", str(runs["tiny-dense"]), "--out",
                 str(tmp_path / "a.png")]) == 2
    assert "pip install -e '.[plot]'" in capsys.readouterr().err
