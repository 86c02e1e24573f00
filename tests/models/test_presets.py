"""Presets: every one builds on the meta device, lands on its paper row's parameter count, and its
name says what it builds. The expectations are transcribed from SwitchHead Table 9,
§8 (Table 6) and §6 (MoA: d_h = 88, E = 10), independently of moeify.models.presets."""

import json
import re

import pytest

from moeify.cli.main import main
from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.depth import MoDConfig
from moeify.layers.feedforward import DenseFFConfig, SigmaMoEConfig, SwitchFFConfig
from moeify.layers.moa import MoAConfig
from moeify.layers.moh import MoHConfig
from moeify.layers.mosa import MoSAConfig
from moeify.layers.switchhead import SwitchHeadConfig
from moeify.models.params import model_parameters
from moeify.models.moeut_presets import MOEUT_BASELINE_ROWS, MOEUT_ROWS, SIGMA_MOE_ROWS
from moeify.models.moh_presets import MOH_PAPER_PRESETS
from moeify.models.mosa_presets import MOSA_LONG_PRESETS, MOSA_PAPER_PRESETS
from moeify.models.mor_presets import MOR_PRESETS
from moeify.models.remoe_presets import REMOE_PRESETS
from moeify.models.presets import PRESETS, get_preset

# MoEUT's table rows (MoEUT, its dense baselines and the hyperparameter table's sigma-MoE runs)
# have their own tests against the #params labels, one per size
# (tests/models/test_moeut_presets.py); so have MoSA's
# (tests/models/test_mosa_paper_rows.py), Mixture-of-Recursions' (tests/models/test_mor.py),
# MoH's (tests/models/test_moh_presets.py) and ReMoE's (tests/models/test_remoe_model.py).
PAPER = [n for n in PRESETS if not n.startswith(("tiny-", "repro-", "repro256-"))
         and n not in MOEUT_ROWS and n not in MOEUT_BASELINE_ROWS and n not in SIGMA_MOE_ROWS
         and n not in {p.name for p in MOSA_PAPER_PRESETS + MOSA_LONG_PRESETS + MOR_PRESETS + MOH_PAPER_PRESETS
                       + REMOE_PRESETS}]
TINY = [n for n in PRESETS if n.startswith("tiny-")]

# size tag -> (d, L, T, XL, dense heads, dense d_h, dense d_ff, vocab)
SIZES = {
    "47m": (412, 16, 256, True, 10, 41, 2053, 8000),
    "262m": (1024, 18, 512, True, 16, 64, 4110, 8000),
    "259m": (1024, 18, 512, True, None, None, None, 8000),
    "41m": (512, 12, 512, True, 8, 64, 2053, 205),
    "45m": (412, 16, 512, False, 10, 41, 2053, 8000),
    "244m": (1024, 18, 1024, False, 16, 64, 4110, 8000),
    "243m": (1024, 18, 1024, False, None, None, None, 8000),
}
# (dataset, size) -> SwitchHead row (H, d_h, E, k, d_ff) of Table 9.
SWITCHHEAD_ROWS = {
    ("wt103", "47m"): (2, 76, 5, 2, 2080), ("c4", "47m"): (2, 76, 5, 3, 2080),
    ("pes2o", "47m"): (2, 76, 5, 3, 2080), ("wt103", "262m"): (2, 132, 8, 4, 4147),
    ("c4", "262m"): (4, 112, 4, 2, 4188), ("pes2o", "262m"): (4, 112, 4, 2, 4188),
    ("enwik8", "41m"): (2, 112, 4, 2, 2088), ("wt103", "45m"): (2, 64, 5, 3, 2092),
    ("wt103", "243m"): (4, 100, 4, 2, 4136),
}
SWITCHALL_ROWS = {  # attention (H, d_h, E, k), sigma-MoE experts (G = 128, k = 4)
    ("wt103", "47m"): ((2, 76, 5, 2), 16), ("c4", "47m"): ((2, 76, 5, 3), 16),
    ("pes2o", "47m"): ((2, 76, 5, 3), 16), ("wt103", "259m"): ((4, 112, 4, 2), 32),
    ("c4", "259m"): ((4, 112, 4, 2), 32), ("pes2o", "259m"): ((4, 112, 4, 2), 32),
}
TABLE6 = {"o": (112, 2065), "ko": (76, 2080), "vok": (56, 2115), "voq": (56, 2115),
          "v": (112, 2065), "qo": (76, 2080), "vq": (76, 2080), "vkqo": (48, 2060),
          "qko": (56, 2115), "qkv": (56, 2115), "vk": (76, 2080), "q": (112, 2065),
          "k": (112, 2065), "qk": (76, 2080)}
# MAC-matched variants (§4): (H, d_h) and the parameter count of the row.
MACMATCHED = {"47m": ((3, 112), 63), "262m": ((6, 168), 376), "45m": ((3, 84), 54)}


def expected_millions(name: str) -> int:
    size = name.split("-")[1]
    if name.endswith("-macmatched"):
        return MACMATCHED[size][1]
    return int(size[:-1])


def test_issue_table_names_exist():
    names = ["wt103-47m-dense", "wt103-47m-dense-h2", "wt103-47m-switchhead",
             "wt103-47m-switchall", "wt103-47m-switchhead-macmatched",
             "wt103-47m-switchhead-sharedsel", "wt103-262m-dense", "wt103-262m-dense-h2",
             "wt103-262m-switchhead", "c4-262m-dense", "c4-262m-dense-h4", "c4-262m-switchhead",
             "pes2o-262m-dense", "pes2o-262m-dense-h4", "pes2o-262m-switchhead",
             "wt103-259m-switchall", "enwik8-41m-dense", "enwik8-41m-dense-h2",
             "enwik8-41m-switchhead", "wt103-45m-rope-dense", "wt103-45m-rope-dense-h2",
             "wt103-45m-rope-switchhead", "wt103-244m-rope-dense", "wt103-244m-rope-dense-h2",
             "wt103-243m-rope-switchhead"]
    for ds in ("wt103", "c4", "pes2o"):
        names += [f"{ds}-47m-moa-h{h}" for h in (2, 4, 6, 8)]
        names += [f"{ds}-47m-{m}" for m in ("dense", "dense-h2", "switchhead", "switchall",
                                            "switchhead-macmatched", "switchhead-sharedsel")]
    names += [f"wt103-47m-switchhead-experts-{t}" for t in TABLE6]
    names += ["tiny-dense", "tiny-switchhead", "tiny-moa", "tiny-sigmamoe", "tiny-switchall",
              "tiny-switch", "tiny-mod", "tiny-mode", "tiny-mode-integrated"]
    missing = sorted(set(names) - set(PRESETS))
    assert not missing
    assert all(PRESETS[n].description for n in PRESETS)


@pytest.mark.parametrize("name", PAPER)
def test_paper_preset_builds_on_meta_and_rounds_to_its_row(name):
    total = model_parameters(get_preset(name))["total"]
    assert round(total / 1e6) == expected_millions(name), total


def test_wt103_47m_pair_matches_the_authors_counts():
    # Table 9: the authors' modules give these exact counts.
    dense = model_parameters(get_preset("wt103-47m-dense"))["total"]
    sh = model_parameters(get_preset("wt103-47m-switchhead"))["total"]
    assert abs(dense - 47_260_136) / 47_260_136 < 1e-3
    assert abs(sh - 47_247_416) / 47_247_416 < 1e-3


def _uniform(layers):
    assert all(x == layers[0] for x in layers)
    return layers[0]


@pytest.mark.parametrize("name", PAPER)
def test_paper_preset_name_says_what_it_builds(name):
    cfg = get_preset(name)
    parts = name.split("-")
    ds, size = parts[0], parts[1]
    d, L, T, xl, dense_h, dense_dh, dense_dff, vocab = SIZES[size]
    assert (cfg.d_model, cfg.n_layers, cfg.context_length, cfg.vocab_size) == (d, L, T, vocab)
    rope = "rope" in parts
    assert cfg.xl_memory == (not rope) == xl
    att = _uniform(cfg.attention_layers())
    ff = _uniform(cfg.feedforward_layers())
    assert att.pos == ("rope" if rope else "xl") and att.n_layers == L
    desc = PRESETS[name].description

    if "dense" in parts:
        m = re.search(r"-h(\d+)$", name)
        H = int(m.group(1)) if m else dense_h
        assert isinstance(att, DenseAttentionConfig)
        assert (att.n_heads, att.n_heads * att.d_head) == (H, dense_h * dense_dh)
        assert isinstance(ff, DenseFFConfig) and ff.d_ff == dense_dff
        assert f"H={H}" in desc
    elif "moa" in parts:
        H = int(re.search(r"-moa-h(\d+)$", name).group(1))
        assert isinstance(att, MoAConfig)
        assert (att.k, att.n_experts, att.d_head) == (H, 10, 88)
        assert f"H={H}" in desc and "E=10" in desc
    elif "switchall" in parts:
        (H, dh, E, k), ffE = SWITCHALL_ROWS[(ds, size)]
        assert isinstance(att, SwitchHeadConfig) and isinstance(ff, SigmaMoEConfig)
        assert (att.n_heads, att.d_head, att.n_experts, att.k) == (H, dh, E, k)
        assert (ff.n_experts, ff.expert_size, ff.k) == (ffE, 128, 4)
        assert f"H={H}" in desc and f"E={E}" in desc and f"k={k}" in desc
    else:
        assert "switchhead" in parts and isinstance(att, SwitchHeadConfig)
        H, dh, E, k, dff = SWITCHHEAD_ROWS[(ds, size)]
        experts = {"v", "o"}
        if "experts" in parts:
            experts = set(parts[-1])
            dh, dff = TABLE6[parts[-1]]
        if "macmatched" in parts:
            H, dh = MACMATCHED[size][0]
        assert (att.n_heads, att.d_head, att.n_experts, att.k) == (H, dh, E, k)
        assert set(att.experts) == experts
        assert att.shared_selection == ("sharedsel" in parts)
        assert isinstance(ff, DenseFFConfig) and ff.d_ff == dff
        assert f"H={H}" in desc and f"E={E}" in desc and f"k={k}" in desc


TINY_FAMILY = {  # name -> (attention type, feedforward type, MoD on blocks)
    "tiny-dense": (DenseAttentionConfig, DenseFFConfig, False),
    "tiny-switchhead": (SwitchHeadConfig, DenseFFConfig, False),
    "tiny-moa": (MoAConfig, DenseFFConfig, False),
    "tiny-sigmamoe": (DenseAttentionConfig, SigmaMoEConfig, False),
    "tiny-switchall": (SwitchHeadConfig, SigmaMoEConfig, False),
    "tiny-switch": (DenseAttentionConfig, SwitchFFConfig, False),
    "tiny-mod": (DenseAttentionConfig, DenseFFConfig, True),
    "tiny-mode": (DenseAttentionConfig, (SwitchFFConfig, SigmaMoEConfig), True),
    "tiny-mode-integrated": (DenseAttentionConfig, SwitchFFConfig, False),
    "tiny-moeut": (SwitchHeadConfig, SigmaMoEConfig, False),
    "tiny-mosa": (MoSAConfig, DenseFFConfig, False),
    "tiny-moh": (MoHConfig, DenseFFConfig, False),
}


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_name_says_what_it_builds(name):
    cfg = get_preset(name)
    att_t, ff_t, routed = TINY_FAMILY[name]
    assert cfg.vocab_size == 256 and cfg.n_layers == 4 and 64 <= cfg.d_model <= 256
    assert all(isinstance(a, att_t) for a in cfg.attention_layers())
    assert all(isinstance(f, ff_t) for f in cfg.feedforward_layers())
    assert any(isinstance(d, MoDConfig) for d in cfg.depth_layers()) == routed
    if name == "tiny-mode-integrated":
        assert cfg.feedforward_layers()[0].noop_experts > 0
    assert model_parameters(cfg)["total"] < 3_000_000


def test_unknown_preset_suggests_names():
    with pytest.raises(ValueError, match="did you mean wt103-47m-switchhead"):
        get_preset("wt103-47m-switchhed")


def test_presets_cli(capsys):
    assert main(["presets", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in listed] == list(PRESETS)
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(PRESETS)
    assert any(line.startswith("wt103-47m-switchhead ") and "E=5" in line for line in lines)


REPRO = ["repro-dense", "repro-dense-h2", "repro-switchhead", "repro-moa", "repro-switchall"]


def test_repro_family_is_registered_with_the_others_and_parameter_matched(capsys):
    # Listed by `moeify presets` without importing anything else (a fresh import of the
    # registry is what every subcommand sees).
    assert main(["presets"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert set(REPRO) <= listed
    dense = get_preset("repro-dense")
    sh, moa = get_preset("repro-switchhead"), get_preset("repro-moa")
    a = sh.attention_layers()[0]
    # SwitchHead §3: H·E equals the baseline's head count; the parameter budget is matched.
    assert isinstance(a, SwitchHeadConfig) and a.n_heads * a.n_experts == 8
    assert isinstance(moa.attention_layers()[0], MoAConfig)
    total = {n: model_parameters(get_preset(n))["total"] for n in REPRO}
    for n in ("repro-dense-h2", "repro-switchhead", "repro-moa"):
        assert abs(total[n] - total["repro-dense"]) <= 0.01 * total["repro-dense"], (n, total)
    assert abs(total["repro-switchall"] - total["repro-dense"]) <= 0.01 * total["repro-dense"]
    assert isinstance(get_preset("repro-switchall").feedforward[0], SigmaMoEConfig)
    assert dense.xl_memory and dense.context_length == 128


def test_every_preset_name_is_written_in_the_source():
    # A preset is found by grepping its name: the table is literal, no name is assembled.
    from pathlib import Path

    import moeify.models.moeut_presets as moeut_module
    import moeify.models.moh_presets as moh_module
    import moeify.models.mor_presets as mor_module
    import moeify.models.mosa_presets as mosa_module
    import moeify.models.presets as presets_module
    import moeify.models.remoe_presets as remoe_module
    import moeify.models.repro_presets as repro_module

    text = "".join(Path(m.__file__).read_text()
                   for m in (presets_module, repro_module, moeut_module, mosa_module,
                             mor_module, moh_module, remoe_module))
    assert [n for n in PRESETS if f'"{n}"' not in text] == []


@pytest.mark.parametrize("name", PAPER)
def test_paper_rows_carry_dataset_baseline_and_recipe(name):
    row = PRESETS[name]
    assert row.data in ("wikitext-103", "c4", "pes2o", "enwik8")
    assert row.data.replace("wikitext-103", "wt103") == name.split("-")[0]
    assert row.recipe is not None
    if row.baseline is None:
        assert isinstance(_uniform(get_preset(name).attention_layers()), DenseAttentionConfig)
        assert name.endswith("-dense")
    else:
        base = get_preset(row.baseline)
        assert isinstance(_uniform(base.attention_layers()), DenseAttentionConfig)
        assert (base.d_model, base.context_length) == (get_preset(name).d_model,
                                                       get_preset(name).context_length)


def test_repro_mac_matched_shared_selection_and_x4_family():
    import dataclasses

    from moeify.models.cost import model_cost
    from moeify.models.repro_presets import MACMATCHED_D_HEAD

    def macs(cfg):
        return model_cost(cfg).layers[0]["macs"]

    def params(name):
        return model_parameters(get_preset(name))["total"]

    dense, mm = get_preset("repro-dense"), get_preset("repro-switchhead-macmatched")
    a = mm.attention_layers()[0]
    assert (a.n_heads, a.d_head, a.n_experts, a.k) == (3, MACMATCHED_D_HEAD, 4, 2)
    # §3.5: the largest d_head (multiple of 4) at no more than the dense model's MACs.
    assert macs(mm) <= macs(dense)
    wider = dataclasses.replace(a, d_head=a.d_head + 4)
    assert macs(dataclasses.replace(mm, attention=(wider,))) > macs(dense)
    assert params("repro-switchhead-macmatched") > 1.3 * params("repro-dense")
    shared = get_preset("repro-switchhead-sharedsel").attention_layers()[0]
    assert shared.shared_selection
    big = params("repro256-dense")
    assert 3.5 * params("repro-dense") < big < 4.5 * params("repro-dense")
    for n in ("repro-switchhead-sharedsel",):
        assert abs(params(n) - params("repro-dense")) <= 0.01 * params("repro-dense")
    for n in ("repro256-dense-h2", "repro256-switchhead", "repro256-moa"):
        assert abs(params(n) - big) <= 0.01 * big, n
    sh = get_preset("repro256-switchhead").attention_layers()[0]
    assert sh.n_heads * sh.n_experts == 8 and get_preset("repro256-dense").d_model == 256
