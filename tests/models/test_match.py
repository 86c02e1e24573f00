"""Parameter matching (SwitchHead §3) against the d_head / d_ff the paper chose (Table 9,
Table 6), with attention parameter counts transcribed by hand from §1."""

import json

import pytest

from moeify.cli.main import main
from moeify.layers.switchhead import SwitchHeadConfig
from moeify.models.params import model_parameters
from moeify.models.match import match_attention
from moeify.models.presets import get_preset, match_preset


def dense_xl_attention(d, H, dh):
    # Q, K, V, O and the position projection; the u and v biases; the learned scalar scale
    return 5 * d * H * dh + 2 * H * dh + 1


def switchhead_attention(d, H, dh, E, experts, xl):
    n = sum(H * E * d * dh if p in experts else d * H * dh for p in "qkvo")
    n_sel = int(bool(set(experts) & {"k", "v"})) + int(bool(set(experts) & {"q", "o"}))
    return n + n_sel * d * H * E + (d * H * dh if xl else 0)


def test_wt103_47m_switchhead_from_10_head_dense():
    r = match_preset("wt103-47m-dense", n_heads=2, n_experts=5, k=2)
    assert r.d_head == 76
    assert r.d_ff == 2080  # Table 9 exactly (the module docstring promises it)
    # §5 by hand: d_ff* = 2053 + (attention deficit) / (2·d + 1 per hidden unit), expressed as
    # ff_multiplier = d_ff* / d with two decimals, d_ff = int(d · ff_multiplier).
    deficit = dense_xl_attention(412, 10, 41) - switchhead_attention(412, 2, 76, 5, "vo", True)
    assert r.d_ff == _d_ff_by_hand(412, 2053, deficit)
    # §5: the attention gets (slightly) fewer parameters than the dense one ...
    dense_att = dense_xl_attention(412, 10, 41)
    assert r.dense_attention_params == dense_att
    assert r.attention_params == switchhead_attention(412, 2, 76, 5, "vo", True) <= dense_att
    # ... and d_head is the largest multiple of 4 for which that holds.
    assert switchhead_attention(412, 2, 80, 5, "vo", True) > dense_att
    # totals match closely, and the reported difference is the difference
    assert abs(r.relative_difference) < 5e-4
    assert r.difference == (model_parameters(r.config)["total"]
                            - model_parameters(get_preset("wt103-47m-dense"))["total"])
    att = r.config.attention[0]
    assert isinstance(att, SwitchHeadConfig) and (att.n_heads, att.n_experts, att.k) == (2, 5, 2)


@pytest.mark.parametrize("preset,H,E,k,d_head,d_ff,tol", [
    ("wt103-262m-dense", 2, 8, 4, 132, 4147, 0),
    ("c4-262m-dense", 4, 4, 2, 112, 4188, 0),
    ("wt103-45m-rope-dense", 2, 5, 3, 64, 2092, 0),
    ("wt103-244m-rope-dense", 4, 4, 2, 100, 4136, 0),
    ("enwik8-41m-dense", 2, 4, 2, 112, 2088, 0.005),
])
def test_table9_rows(preset, H, E, k, d_head, d_ff, tol):
    r = match_preset(preset, n_heads=H, n_experts=E, k=k)
    assert r.d_head == d_head
    assert abs(r.d_ff - d_ff) <= tol * d_ff
    assert abs(r.relative_difference) < 1e-3


@pytest.mark.parametrize("experts,d_head,d_ff", [
    ("o", 112, 2065), ("v", 112, 2065), ("k", 112, 2065), ("q", 112, 2065),
    ("ko", 76, 2080), ("vq", 76, 2080), ("qk", 76, 2080), ("vk", 76, 2080), ("qo", 76, 2080),
    ("vok", 56, 2115), ("voq", 56, 2115), ("qko", 56, 2115), ("qkv", 56, 2115),
    ("vkqo", 48, 2060),
])
def test_table6_expert_subsets(experts, d_head, d_ff):
    r = match_preset("wt103-47m-dense", n_heads=2, n_experts=5, k=2, experts=tuple(experts))
    assert r.d_head == d_head
    assert abs(r.d_ff - d_ff) <= 4  # the paper's own choices are approximate here (§5)


def _d_ff_by_hand(d, d_ff_dense, deficit):
    exact = d_ff_dense + deficit / (2 * d + 1)  # a dense FFN unit: d in, d out, one bias
    return int(d * (round(exact * 100 / d) / 100) + 1e-9)


def test_moa_presets_use_the_matched_d_ff():
    # MoA at d_h = 88, E = 10 has 2·E·d·d_h (expert Q, O) + 3·d·d_h (K, V, XL projection) + E·d
    # (router) parameters, whatever the number H of selected heads: one d_ff for every H.
    moa_att = 23 * 412 * 88 + 10 * 412
    want = _d_ff_by_hand(412, 2053, dense_xl_attention(412, 10, 41) - moa_att)
    assert want == 2060
    for H in (2, 4, 6, 8):
        r = match_preset("wt103-47m-dense", n_heads=H, n_experts=10, kind="moa", d_head=88)
        assert r.attention_params == moa_att
        assert r.d_ff == want
        assert get_preset(f"wt103-47m-moa-h{H}").feedforward[0].d_ff == want
    # searching d_head instead lands on Table 1's back-solved 88 as well:
    # MoA has 2·E·d·d_h (expert Q, O) + 3·d·d_h (K, V, XL projection) + E·d (router)
    r = match_preset("wt103-47m-dense", n_heads=4, n_experts=10, kind="moa")
    assert r.d_head == 88 == max(c for c in range(4, 200, 4)
                                 if 23 * 412 * c + 4120 <= dense_xl_attention(412, 10, 41))


def test_match_validation():
    with pytest.raises(ValueError, match="needs k"):
        match_preset("wt103-47m-dense", n_heads=2, n_experts=5)
    with pytest.raises(ValueError, match="must have dense attention"):
        match_preset("wt103-47m-switchhead", n_heads=2, n_experts=5, k=2)
    with pytest.raises(ValueError, match="dense feedforward"):
        match_attention(get_preset("tiny-sigmamoe"), n_heads=2, n_experts=4, k=2)
    with pytest.raises(ValueError, match="selected heads is its k"):
        match_preset("wt103-47m-dense", n_heads=2, n_experts=10, k=3, kind="moa")
    with pytest.raises(ValueError, match="more attention parameters"):
        match_preset("wt103-47m-dense", n_heads=64, n_experts=64, k=2)
    with pytest.raises(ValueError, match="kind must be one of"):
        match_preset("wt103-47m-dense", n_heads=2, n_experts=5, k=2, kind="dense")


def test_match_cli(capsys):
    assert main(["match", "--preset", "wt103-47m-dense", "-H", "2", "-E", "5", "-k", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["d_head"], out["d_ff"]) == (76, 2080)
    assert out["difference"] == out["params"] - out["dense_params"]
    assert out["config"]["attention"][0]["type"] == "SwitchHeadConfig"
    assert main(["match", "--preset", "wt103-47m-dense", "-H", "2", "-E", "5", "-k", "2"]) == 0
    assert "d_head = 76" in capsys.readouterr().out
    assert main(["match", "--preset", "nope", "-H", "2", "-E", "5", "-k", "2"]) == 2
    assert "unknown preset" in capsys.readouterr().err
