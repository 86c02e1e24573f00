"""Cost accounting against the numbers the SwitchHead paper printed (Table 9 and the MACs / memory
tables), and
parameter counts against a hand transcription of the modules' weight shapes."""

import json

from moeify.cli.main import main

import pytest

from moeify.models.cost import (dense_attention_cost, format_count, moa_cost, model_cost,
                                model_parameters, switchhead_cost)
from moeify.models.lm import TransformerLM
from moeify.models.presets import get_preset

# --------------------------------------------------------------------------- §6 worked examples


def test_dense_xl_worked_example():
    c = dense_attention_cost(d_model=412, n_heads=10, d_head=41, T=256, C=2, xl=True)
    assert (c.macs, c.memory) == (453_427_200, 3_461_120)
    assert (format_count(c.macs), format_count(c.memory)) == ("453.4M", "3.5M")


def test_switchhead_worked_example():
    c = switchhead_cost(d_model=412, n_heads=2, d_head=76, n_experts=5, k=2, T=256, C=2,
                        experts=("v", "o"), xl=True)
    assert (c.macs, c.memory) == (170_364_928, 762_880)
    assert (format_count(c.macs), format_count(c.memory)) == ("170.4M", "0.8M")


@pytest.mark.parametrize("H,printed", [(2, "140.1M"), (4, "223.5M"), (6, "306.8M"),
                                       (8, "390.2M")])
def test_moa_table1_rows(H, printed):
    # Table 1: MoA at WT103 47M, only d_h = 88, E = 10 (with the accounting's k = 2) print these.
    c = moa_cost(d_model=412, n_heads=H, d_head=88, n_experts=10, T=256, C=2, xl=True)
    assert format_count(c.macs) == printed


def test_switchhead_all_dense_equals_dense_rope_plus_nothing():
    # With no expert projection SwitchHead has 4 plain projections and no selection: the dense
    # RoPE formula exactly (an independent consistency check of the n_proj / n_sels terms).
    sh = switchhead_cost(d_model=64, n_heads=3, d_head=16, n_experts=4, k=2, T=32, C=1,
                         experts=(), xl=False)
    dense = dense_attention_cost(d_model=64, n_heads=3, d_head=16, T=32, C=1, xl=False)
    assert sh == dense


def test_switchhead_selection_count():
    base = dict(d_model=10, n_heads=1, d_head=1, n_experts=3, k=1, T=1, C=1, xl=False)
    # k = 1 makes every projection cost the same, so the only difference is E·d·T·C per
    # selection (and the n_exp·H·k·T·d_h gating term).
    def extra(experts):
        c = switchhead_cost(experts=experts, **base)
        return c.macs - dense_attention_cost(d_model=10, n_heads=1, d_head=1, T=1, C=1,
                                             xl=False).macs - len(experts)
    assert extra(("q", "k", "v", "o")) == 2 * 30
    assert extra(("v", "k")) == 1 * 30
    assert extra(("q", "o")) == 1 * 30
    assert extra(("q", "k")) == 2 * 30
    assert extra(("o",)) == 1 * 30


def test_format_count_switches_to_g_above_1000m():
    assert format_count(12_345) == "12.3K"  # a tiny model's count was printed "0.0M"
    assert format_count(49_999) == "50.0K" and format_count(50_000) == "0.1M"
    assert format_count(999_949_999) == "999.9M"
    assert format_count(2_400_000_000) == "2.4G"
    assert format_count(1_000_000_001) == "1.0G"


def test_cost_rejects_bad_input():
    with pytest.raises(ValueError, match="experts must be a subset"):
        switchhead_cost(d_model=4, n_heads=1, d_head=1, n_experts=2, k=1, T=1, C=1,
                        experts=("x",), xl=False)
    with pytest.raises(ValueError, match="T must be a positive integer"):
        dense_attention_cost(d_model=4, n_heads=1, d_head=1, T=0, C=1, xl=False)


# --------------------------------------------------------------------------- parameters


def lm_params(V, d, L, attention, ff):
    """Embedding V·d, per block attention + feedforward + two LayerNorms (2·d each), final
    LayerNorm, untied output layer with bias."""
    return V * d + L * (attention + ff + 4 * d) + 2 * d + d * V + V


def dense_ff_params(d, f):
    return 2 * d * f + f + d


def test_dense_xl_parameters_by_hand():
    # WT103 47M dense XL: Q K V O + position projection, u, v, scale; no attention biases.
    att = 5 * 412 * 410 + 2 * 410 + 1
    assert model_parameters(get_preset("wt103-47m-dense"))["total"] == lm_params(
        8000, 412, 16, att, dense_ff_params(412, 2053)) == 47_260_120  # authors: +16 (§4)


def test_switchhead_parameters_by_hand():
    # Q, K dense (d -> H·d_h), V and O H·E experts, two selections d -> H·E, XL projection.
    att = 2 * 412 * 152 + 2 * 10 * 412 * 76 + 2 * 412 * 10 + 412 * 152
    assert model_parameters(get_preset("wt103-47m-switchhead"))["total"] == lm_params(
        8000, 412, 16, att, dense_ff_params(412, 2080)) == 47_247_416


def test_rope_and_moa_and_switchall_parameters_by_hand():
    rope_att = 2 * 412 * 128 + 2 * 10 * 412 * 64 + 2 * 412 * 10  # no position projection
    assert model_parameters(get_preset("wt103-45m-rope-switchhead"))["total"] == lm_params(
        8000, 412, 16, rope_att, dense_ff_params(412, 2092))
    moa_att = 2 * 10 * 412 * 88 + 2 * 412 * 88 + 10 * 412 + 412 * 88  # experts, K/V, router, XL
    assert model_parameters(get_preset("wt103-47m-moa-h4"))["total"] == lm_params(
        8000, 412, 16, moa_att, dense_ff_params(412, 2060))
    sigma = 2 * 16 * 412 * 128 + 16 * 412  # keys, values, selection; no biases
    sh_att = 2 * 412 * 152 + 2 * 10 * 412 * 76 + 2 * 412 * 10 + 412 * 152
    assert model_parameters(get_preset("wt103-47m-switchall"))["total"] == lm_params(
        8000, 412, 16, sh_att, sigma)


def test_counting_never_allocates_weights():
    # ~14 billion parameters: allocating them would need tens of GB.
    from moeify.models.config import ModelConfig
    from moeify.models.presets import dense_attn, dense_ff

    d, L = 8192, 16
    cfg = ModelConfig(vocab_size=256_000, d_model=d, n_layers=L, context_length=2048,
                      attention=dense_attn(d=d, L=L, H=64, d_h=128, pos="rope"),
                      feedforward=dense_ff(d=d, L=L, d_ff=4 * d, dropout=0.0), xl_memory=False)
    total = model_parameters(cfg)["total"]
    assert total == lm_params(256_000, d, L, 4 * d * d, dense_ff_params(d, 4 * d))
    assert format_count(total) == f"{total / 1e9:.1f}G"


# --------------------------------------------------------------------------- model_cost, CLI


def test_model_cost_rows_match_the_worked_examples():
    sh = model_cost(get_preset("wt103-47m-switchhead"))
    assert (sh.T, sh.C, len(sh.layers)) == (256, 2, 16)
    assert {(r["macs"], r["memory"]) for r in sh.layers} == {(170_364_928, 762_880)}
    dense = model_cost(get_preset("wt103-47m-dense"))
    assert {(r["macs"], r["memory"]) for r in dense.layers} == {(453_427_200, 3_461_120)}
    rope = model_cost(get_preset("wt103-45m-rope-dense"))
    assert rope.C == 1 and rope.layers[0]["macs"] == 2 * 410 * 512**2 + 4 * 412 * 410 * 512


def test_mod_blocks_count_only_routed_tokens():
    c = model_cost(get_preset("tiny-mod"))
    tokens = [r["tokens"] for r in c.layers]
    assert tokens == [128, 16, 128, 16]  # capacity 0.125 of T = 128 on every other block
    assert c.layers[1]["macs"] == dense_attention_cost(d_model=128, n_heads=4, d_head=32, T=16,
                                                        C=1, xl=False).macs


def test_count_cli(capsys, tmp_path):
    assert main(["count", "--preset", "wt103-47m-switchhead", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 47_247_416
    assert out["layers"][0]["macs"] == 170_364_928 and out["layers"][0]["macs_str"] == "170.4M"
    assert main(["count", "--preset", "wt103-47m-dense"]) == 0
    text = capsys.readouterr().out
    assert "453.4M" in text and "3.5M" in text and "47,260,120" in text
    path = tmp_path / "config.json"
    path.write_text(get_preset("tiny-switchhead").to_json())
    assert main(["count", "--config", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == model_parameters(
        get_preset("tiny-switchhead"))["total"]


@pytest.mark.parametrize("name", ["tiny-mod", "tiny-switchall", "tiny-moa"])
def test_meta_count_equals_the_real_model(name):
    cfg = get_preset(name)
    parts = model_parameters(cfg)
    real = TransformerLM(cfg)
    assert parts["total"] == sum(p.numel() for p in real.parameters())
    assert parts["attention"] == sum(p.numel() for n, p in real.named_parameters()
                                     if ".attention." in n)


def test_mosa_local_heads_by_hand():
    """The long-sequence hybrid's local heads (w = 3): per head 4·d·h'·T projections and
    2·h'·T·2w attention MACs (blocked: every query against 2w keys); MoSA's paper FLOPs have
    no term for them, so a model with them has none."""
    import dataclasses

    from moeify.models.cost import model_paper_flops, mosa_cost
    from moeify.models.presets import get_preset

    base = mosa_cost(d_model=8, n_heads=3, d_head=4, k=4, T=12)
    hyb = mosa_cost(d_model=8, n_heads=3, d_head=4, k=4, T=12, n_local_heads=2, local_window=3)
    assert hyb.macs - base.macs == 2 * (4 * 8 * 4 * 12 + 2 * 4 * 12 * 6)
    assert hyb.memory - base.memory == 2 * (2 * 12 * 6 + 4 * 4 * 12)
    cfg = get_preset("repro-mosa-paper")
    assert model_paper_flops(cfg) is not None
    attn = dataclasses.replace(cfg.attention_layers()[0], n_local_heads=1, local_window=32)
    assert model_paper_flops(dataclasses.replace(cfg, attention=attn)) is None


@pytest.mark.parametrize("kw", [
    dict(n_shared=2, k=1, pos="rope"),                        # W_r [2, d], W_s [2, d], W_h [2, d]
    dict(n_shared=1, k=2, pos="xl", n_kv_heads=2),             # W_r [3, d], W_h [2, d]; XL
    dict(n_shared=0, k=2, pos="none"),                         # W_r [4, d] alone
    dict(n_shared=2, k=1, pos="rope", router="query_norm"),    # no weights: R query norms
])
def test_moh_cost_by_hand(kw):
    """MoH: the MACs are what moeify's layer executes (every head's Q, K, V, O and attention,
    the routers, a gate per head); ``activated_head_macs`` the same with the A = h_s + K heads
    a token activates in place of H for Q, O, the attention, XL's position term and the gates
    (K and V of every key/value head stay)."""
    from moeify.layers.moh import MoHConfig
    from moeify.models.cost import moh_cost

    d, H, dh, T, C = 16, 4, 3, 10, 2
    cfg = MoHConfig(d_model=d, n_heads=H, d_head=dh, **kw)
    Hk, hs, R = kw.get("n_kv_heads", H), kw["n_shared"], H - kw["n_shared"]
    A = hs + kw["k"]
    if kw.get("router") == "query_norm":
        router_macs, scores = R * dh, R
    else:
        scores = R + (hs if hs > 1 else 0) + (2 if hs and R else 0)
        router_macs = scores * d
    xl = kw["pos"] == "xl"

    def macs(n):
        return (2 * n * dh * C * T * T + 2 * d * (n + Hk) * dh * T + router_macs * T
                + n * dh * T + (2 * n * d * T * dh * C if xl else 0))

    c = moh_cost(cfg, T=T, C=C)
    assert c.macs == macs(H)
    assert c.activated_head_macs == macs(A) < c.macs
    assert c.memory == (2 * H * C * T * T + 2 * (H + Hk) * dh * T + scores * T
                        + (2 * H * T * dh * C if xl else 0))
    assert c.to_dict()["activated_head_macs"] == macs(A)
    assert "activated_head_macs" not in dense_attention_cost(
        d_model=d, n_heads=H, d_head=dh, T=T, C=C, xl=xl).to_dict()


def test_moh_count_reports_both_figures(capsys):
    """repro-moh (8 RoPE heads of 16, d 128, T 128; 4 shared + 2 of 4 routed): executed
    2·8·16·128² + 4·128·8·16·128 = 12,582,912 (dense attention) + 10 router rows · 128 · 128
    = 163,840 + 8 gates · 16 · 128 = 16,384; activated heads (6 of 8): 2·6·16·128² +
    2·128·(6 + 8)·16·128 + 163,840 + 6·16·128 = 10,661,888."""
    assert main(["count", "--preset", "repro-moh", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["layers"][0]
    assert (row["macs"], row["activated_head_macs"]) == (12_763_136, 10_661_888)
    assert main(["count", "--preset", "repro-moh"]) == 0
    text = capsys.readouterr().out
    assert "12.8M" in text and "activated-head MACs" in text and "layers 0-3 10.7M" in text
