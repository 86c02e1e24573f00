"""moeify compare on two tiny presets for a few steps: every result field for every preset, the
cost numbers against the formulas of moeify.models.cost written out here, the ordering check, reuse
and
errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from moeify.analysis.compare import RESULT_FIELDS, ordering_over_last
from moeify.analysis.curves import Curve
from moeify.analysis.plotting import read_panels
from moeify.cli.main import main
from moeify.models.config import ModelConfig


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEIFY_CACHE_DIR", str(root / "cache"))
    rng = np.random.default_rng(1)
    words = "a small dog saw the big red ball near our old house today".split()
    (root / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, 9))
                                               for _ in range(300)))
    blimp = root / "blimp"
    blimp.mkdir()
    for uid, field in (("agreement", "morphology"), ("island", "syntax")):
        rows = [{"sentence_good": f"the dog {v}s.", "sentence_bad": f"the dog {v}.", "UID": uid,
                 "field": field} for v in ("run", "see", "eat")]
        (blimp / f"{uid}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["compare", "--presets", "tiny-dense,tiny-switchhead", "--data",
            str(root / "corpus.txt"), "--steps", "3", "--out", str(root / "out"),
            "--set", "tokenizer=byte", "--set", "batch_size=2", "--set", "model.d_model=32",
            "--set", "model.n_layers=2", "--set", "model.context_length=16",
            "--set", "eval_every=1", "--set", "eval_tokens=128", "--set", "log_every=1",
            "--jobs", "2", "--final-eval-tokens", "256", "--blimp-data", str(blimp),
            "--blimp-per-paradigm", "3", "--last-k", "2"]
    try:
        assert main(args) == 0
        yield root / "out", args
    finally:
        mp.undo()


def test_results_have_every_field_for_every_preset(compared):
    out, _ = compared
    data = json.loads((out / "results.json").read_text())
    assert data["fields"] == list(RESULT_FIELDS)
    rows = {r["preset"]: r for r in data["results"]}
    assert list(rows) == ["tiny-dense", "tiny-switchhead"]
    for r in rows.values():
        missing = [f for f in RESULT_FIELDS if r.get(f) is None]
        assert not missing, f"{r['preset']} lacks {missing}"
        assert r["metric"] == "bpc" and 0 < r["final_valid"] < 9
        assert r["final_valid"] == pytest.approx(r["final_valid_loss"] / math.log(2))
        assert r["valid_tokens"] == 256
        assert r["train_tokens"] == 3 * 2 * 16 and r["tokens_per_s"] > 0
        assert r["peak_memory_bytes"] > 50 * 2 ** 20  # a Python process with torch loaded
        assert 0.0 <= r["blimp_accuracy"] <= 1.0 and r["blimp_pairs"] == 6
    # Same seed, same data, same steps for both (the token order follows from them).
    cfgs = data["train_configs"]
    assert cfgs["tiny-dense"]["seed"] == cfgs["tiny-switchhead"]["seed"]
    assert {k: v for k, v in cfgs["tiny-dense"].items() if k != "preset"} == \
        {k: v for k, v in cfgs["tiny-switchhead"].items() if k != "preset"}


def test_costs_match_the_spec_formulas(compared):
    out, _ = compared
    rows = {r["preset"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    d, T, C = 32, 16, 2  # XL memory of one chunk
    # Dense XL (moeify.models.cost): 2·H·d_h·C·T² + 4·d·H·d_h·T + 2·H·d·T·d_h·C; tiny-dense: H=4,
    # d_h=32
    H, dh = 4, 32
    assert rows["tiny-dense"]["attention_macs"] == \
        2 * H * dh * C * T ** 2 + 4 * d * H * dh * T + 2 * H * d * T * dh * C
    assert rows["tiny-dense"]["attention_memory"] == 2 * H * C * T ** 2 + 4 * H * dh * T \
        + 2 * H * T * dh * C
    # SwitchHead V+O (n_exp = 2, n_proj = 2k + 2, n_sels = 2), H=2, d_h=32, E=4, k=2, plus XL.
    H, dh, E, k = 2, 32, 4, 2
    assert rows["tiny-switchhead"]["attention_macs"] == (
        2 * H * dh * C * T ** 2 + (2 * k + 2) * d * H * dh * T + 2 * H * k * T * dh
        + 2 * E * d * T * C + 2 * H * d * T * dh)
    for name, r in rows.items():
        cfg = ModelConfig.from_json((out / "runs" / name / "model.json").read_text())
        assert r["params"] == sum(p.numel() for p in cfg.build().parameters())
        assert r["attention_macs_total"] == 2 * r["attention_macs"]  # two identical layers


def test_markdown_curves_and_ordering(compared):
    out, _ = compared
    md = (out / "results.md").read_text()
    assert "| tiny-dense |" in md and "| tiny-switchhead |" in md and "valid bpc" in md
    assert read_panels(out / "curves.png")[0] == "training bpc vs tokens"
    data = json.loads((out / "results.json").read_text())
    assert data["ordering"]["steps"] == [2, 3]
    for step, ranking in zip(data["ordering"]["steps"], data["ordering"]["rankings"]):
        curves = data["valid_curves"]
        at = {p: c["bpc"][c["step"].index(step)] for p, c in curves.items()}
        assert ranking == sorted(at, key=at.get)


def test_rerun_refuses_then_reuses(compared, capsys):
    out, args = compared
    assert main(args) == 2
    assert "already holds a finished run" in capsys.readouterr().err
    before = json.loads((out / "results.json").read_text())["results"]
    assert main(args + ["--reuse"]) == 0
    data = json.loads((out / "results.json").read_text())
    after = data["results"]
    assert [r["final_valid"] for r in after] == [r["final_valid"] for r in before]
    # The settings are the training's, not the tabulation's: the runs' own wall times.
    walls = [json.loads((out / "runs" / p / "compare_child.json").read_text())["train_wall_s"]
             for p in ("tiny-dense", "tiny-switchhead")]
    assert data["settings"]["runs_wall_s"] == pytest.approx(round(sum(walls), 1))
    assert data["settings"]["threads_per_run"] == 1


def test_exact_parameter_counts_in_markdown(compared):
    out, _ = compared
    md = (out / "results.md").read_text()
    for r in json.loads((out / "results.json").read_text())["results"]:
        assert f"| {r['preset']} | {r['params']:,} |" in md


def _small(root, presets="tiny-dense", *extra):
    return ["compare", "--presets", presets, "--data", str(root / "corpus.txt"), "--steps", "2",
            "--out", str(root / "out"), "--set", "batch_size=2", "--set", "model.d_model=32",
            "--set", "model.n_layers=2", "--set", "model.context_length=16",
            "--set", "eval_every=1", "--set", "eval_tokens=64", "--set", "log_every=1",
            "--final-eval-tokens", "64", "--blimp-per-paradigm", "0", "--threads", "1", *extra]


def test_auto_tokenizer_is_bytes_for_byte_presets_and_leftovers_are_cleared(
        text_corpus, monkeypatch, capsys):
    from moeify.analysis import curves
    from moeify.errors import MoeifyError
    from moeify.train.overrides import byte_level_preset

    assert byte_level_preset("repro-dense") and byte_level_preset("tiny-switchhead")
    assert not byte_level_preset("wt103-47m-dense")
    # A failed earlier attempt left its files: the same --out must be accepted.
    left = text_corpus / "out" / "runs" / "tiny-dense"
    left.mkdir(parents=True)
    (left / "compare_spec.json").write_text(json.dumps({"name": "tiny-dense"}))
    (left / "train.log").write_text("ModuleNotFoundError: No module named 'sentencepiece'\n")

    def no_matplotlib():
        raise MoeifyError("plotting needs matplotlib: pip install -e '.[plot]'")

    monkeypatch.setattr(curves, "pyplot", no_matplotlib)
    assert main(_small(text_corpus)) == 0  # tokenizer "auto", a local text file
    err = capsys.readouterr().err
    assert "clearing the unfinished attempt" in err
    assert "curves.png not drawn: plotting needs matplotlib" in err
    assert "curves.png" not in err.split("wrote ", 1)[1].split("\n", 1)[0]
    assert not (text_corpus / "out" / "curves.png").exists()
    tok = json.loads((left / "tokenizer.json").read_text())
    assert tok["kind"] == "byte"
    data = json.loads((text_corpus / "out" / "results.json").read_text())
    assert data["results"][0]["metric"] == "bpc" and data["plots"] == []
    assert "not drawn" in (text_corpus / "out" / "results.md").read_text()


def test_interrupted_compare_writes_what_finished(text_corpus, monkeypatch, capsys):
    from moeify.sweep.scheduler import Scheduler
    from moeify.errors import MoeifyError

    reap = Scheduler._reap

    def reap_then_interrupt(self, pid, status, ru):
        reap(self, pid, status, ru)
        raise MoeifyError("interrupted")

    monkeypatch.setattr(Scheduler, "_reap", reap_then_interrupt)
    assert main(_small(text_corpus, "tiny-dense,tiny-switchhead", "--jobs", "1")) == 2
    data = json.loads((text_corpus / "out" / "results.json").read_text())
    assert [r["preset"] for r in data["results"]] == ["tiny-dense"]
    assert data["settings"]["unfinished"] == "tiny-switchhead"
    assert "interrupted" in capsys.readouterr().err


def test_bad_presets(tmp_path, capsys):
    assert main(["compare", "--presets", "tiny-dense,no-such-preset", "--out",
                 str(tmp_path / "o")]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert main(["compare", "--presets", "tiny-dense,tiny-dense", "--out",
                 str(tmp_path / "o")]) == 2


def test_ordering_stability():
    def curve(name, values):
        return Curve(name, "bpc", valid_step=[10, 20, 30], valid_value=values)

    stable = ordering_over_last({"a": curve("a", [3.0, 2.0, 1.0]),
                                 "b": curve("b", [3.5, 2.5, 1.5])}, last_k=2)
    assert stable.steps == [20, 30] and stable.rankings == [["a", "b"], ["a", "b"]]
    assert stable.stable
    flip = ordering_over_last({"a": curve("a", [3.0, 2.0, 1.6]),
                               "b": curve("b", [3.5, 2.5, 1.5])}, last_k=3)
    assert flip.rankings[-1] == ["b", "a"] and not flip.stable
