"""moeify sweep on a tiny grid (2 presets x 2 budgets x 2 seeds, a few steps, tiny models):
an interrupted sweep tabulates what finished and, run again, trains only the rest; the table's
means, standard errors and paired gaps equal a hand computation from the per-run results; the
routing diagnosis equals a hand computation from the logged counts."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from moeify.analysis.sweep import baseline_for, mean_se
from moeify.cli.main import main
from moeify.cli.sweep import parse_ints, parse_variants
from moeify.sweep.grid import grid_specs
from moeify.sweep.protocol import Scoring
from moeify.sweep.scheduler import Scheduler
from moeify.errors import MoeifyError

PRESETS = ("tiny-dense", "tiny-switchhead")
BUDGETS = (2, 3)
SEEDS = (0, 1)


def _args(root, *extra):
    return ["sweep", "--presets", ",".join(PRESETS), "--budgets", "2,3", "--seeds", "0-1",
            "--data", str(root / "corpus.txt"), "--out", str(root / "out"),
            "--set", "batch_size=2", "--set", "model.d_model=32", "--set", "model.n_layers=2",
            "--set", "model.context_length=16", "--set", "eval_every=1",
            "--set", "eval_tokens=128", "--set", "log_every=1", "--set", "checkpoint_every=1",
            "--jobs", "2", "--threads", "1", "--final-eval-tokens", "256", *extra]


def _run_dirs(out):
    return {(p, s, seed): out / "runs" / "base" / p / f"steps-{s}" / f"seed-{seed}"
            for p in PRESETS for s in BUDGETS for seed in SEEDS}


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEIFY_CACHE_DIR", str(root / "cache"))
    rng = np.random.default_rng(3)
    words = "a small dog saw the big red ball near our old house today".split()
    (root / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, 9))
                                               for _ in range(300)))
    # A kill after three finished runs: the scheduler stops the running child and the sweep
    # tabulates what finished before passing the interruption on.
    reap = Scheduler._reap
    finished = []

    def reap_then_kill(self, pid, status, ru):
        reap(self, pid, status, ru)
        finished.append(pid)
        if len(finished) == 3:
            raise MoeifyError("killed")

    mp.setattr(Scheduler, "_reap", reap_then_kill)
    try:
        assert main(_args(root)) == 2
        mp.setattr(Scheduler, "_reap", reap)
        out = root / "out"
        partial = json.loads((out / "results.json").read_text())
        before = {k: (d / "compare_child.json").read_bytes() for k, d in _run_dirs(out).items()
                  if (d / "compare_child.json").is_file()}
        mtimes = {k: (_run_dirs(out)[k] / "compare_child.json").stat().st_mtime_ns
                  for k in before}
        yield root, out, partial, before, mtimes
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def resumed(swept):
    root, out, partial, before, mtimes = swept
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(_args(root)) == 0
    (out / "second_invocation.err").write_text(err.getvalue())
    return json.loads((out / "results.json").read_text())


def test_interrupted_sweep_tabulates_what_finished(swept):
    _, out, partial, before, _ = swept
    # The stopped child may have written its result just before the stop: then it is finished.
    assert 3 <= len(before) <= 4 and 3 <= len(partial["runs"]) <= len(before)
    tabulated = {(r["preset"], r["steps"], r["seed"]) for r in partial["runs"]}
    assert tabulated <= set(before)
    assert len(partial["runs"]) + len(partial["pending"]) <= 4


def test_resume_redoes_no_finished_run(swept, resumed):
    _, out, _, before, mtimes = swept
    dirs = _run_dirs(out)
    for key, content in before.items():
        path = dirs[key] / "compare_child.json"
        assert path.read_bytes() == content
        assert path.stat().st_mtime_ns == mtimes[key]
    assert len(resumed["runs"]) == 8 and resumed["pending"] == []
    assert f"8 runs in the grid, {len(before)} already finished, {8 - len(before)} to train" \
        in (out / "second_invocation.err").read_text()
    for key, d in dirs.items():
        steps = [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().split("\n")
                 if line.startswith('{"kind": "train"')]
        assert steps == list(range(1, key[1] + 1)), key  # every step trained once


def _per_run(out):
    vals = {}
    for (p, s, seed), d in _run_dirs(out).items():
        child = json.loads((d / "compare_child.json").read_text())
        vals[(p, s, seed)] = child["final_valid"]["bpc"]
    return vals


def test_means_errors_and_gaps_by_hand(swept, resumed):
    _, out, _, _, _ = swept
    vals = _per_run(out)
    table = {(r["preset"], r["steps"]): r for r in resumed["table"]}
    assert len(table) == 4
    for p in PRESETS:
        for s in BUDGETS:
            xs = [vals[(p, s, seed)] for seed in SEEDS]
            row = table[(p, s)]
            assert row["n"] == 2 and row["seeds"] == [0, 1]
            assert row["mean"] == pytest.approx(sum(xs) / 2, abs=1e-12)
            assert row["se"] == pytest.approx(statistics.stdev(xs) / math.sqrt(2), abs=1e-12)
            if p == "tiny-dense":
                assert row["gap"] is None and row["baseline"] is None
                continue
            d = [vals[(p, s, seed)] - vals[("tiny-dense", s, seed)] for seed in SEEDS]
            assert row["baseline"] == "tiny-dense" and row["gap_n"] == 2
            assert row["gap"] == pytest.approx(sum(d) / 2, abs=1e-12)
            assert row["gap_se"] == pytest.approx(abs(d[0] - d[1]) / 2, abs=1e-12)
    md = (out / "results.md").read_text()
    r = table[("tiny-switchhead", 3)]
    assert f"{r['mean']:.4f} ± {r['se']:.4f}" in md
    assert f"{r['gap']:+.4f} ± {r['gap_se']:.4f} vs tiny-dense" in md
    assert f"| {r['params']:,} |" in md


def test_recipe_pinned_and_plots(swept, resumed):
    _, out, _, _, _ = swept
    s = resumed["settings"]
    assert s["lr"] == 5e-3 and s["batch_size"] == 2 and s["tokenizer"] == "auto"
    assert resumed["recipe"]["shared"]["eval_every"] == 1
    assert set(resumed["plots"]) == {"valid_curves.png", "gaps.png", "routing.png"}
    from moeify.analysis.plotting import read_panels

    assert read_panels(out / "valid_curves.png") == ["validation bpc vs tokens / time"]


def test_routing_diagnosis_by_hand(swept, resumed):
    _, out, _, _, _ = swept
    E = 4  # tiny-switchhead: H = 2 heads of E = 4 experts
    key = "stats/layers.0.attn.src.counts"
    lasts = []
    for seed in SEEDS:
        d = _run_dirs(out)[("tiny-switchhead", 3, seed)]
        recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        counts = [r for r in recs if r.get("kind") == "train"][-1][key]
        ents = []
        for h in range(len(counts) // E):
            c = np.array(counts[h * E:(h + 1) * E], dtype=float)
            p = c[c > 0] / c.sum()
            ents.append(float(-(p * np.log(p)).sum() / np.log(E)))
        lasts.append(sum(ents) / len(ents))
    row = next(r for r in resumed["routing"] if r["preset"] == "tiny-switchhead"
               and r["steps"] == 3 and r["proj"] == "src" and r["layer"] == 0)
    assert row["entropy"][2] == pytest.approx(sum(lasts) / 2, abs=1e-9)
    assert 0.0 < row["gate"][2] < 1.0


def test_routing_read_from_the_older_metric_names(swept, resumed, tmp_path):
    # Logs of older versions name the statistics per projection (sel_v_counts, ...).
    import shutil

    from moeify.analysis.sweep import routing_series

    _, out, _, _, _ = swept
    src = _run_dirs(out)[("tiny-switchhead", 3, 0)]
    old = tmp_path / "old"
    shutil.copytree(src, old)
    text = (old / "metrics.jsonl").read_text()
    for side, p in (("src", "v"), ("dst", "o")):
        text = text.replace(f"attn.{side}.counts", f"attn.sel_{p}_counts")
        text = text.replace(f"attn.{side}.gate_mean", f"attn.sel_{p}_gate_mean")
    (old / "metrics.jsonl").write_text(text)
    new, legacy = routing_series(src), routing_series(old)
    for layer in (0, 1):
        for side, p in (("src", "v"), ("dst", "o")):
            assert legacy[(layer, p)] == new[(layer, side)]
            assert len(new[(layer, side)]["gate"]) == 3


def test_tabulate_only_rewrites_the_same_table(swept, resumed):
    root, out, _, _, _ = swept
    assert main(["sweep", "--tabulate", "--out", str(out)]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["table"] == resumed["table"]


def test_changed_settings_are_refused(swept, resumed, capsys):
    root, out, _, _, _ = swept
    assert main(_args(root, "--set", "lr=1e-3")) == 2
    assert "already holds a finished run with other settings" in capsys.readouterr().err


def test_grid_order_variants_and_parsing():
    assert parse_ints("0-2,5", "--seeds") == [0, 1, 2, 5]
    with pytest.raises(ValueError, match="distinct"):
        parse_ints("1,1", "--seeds")
    with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
        parse_variants(["lr3e-3"])
    variants = parse_variants(["hot:lr=3e-3", "hot:warmup_steps=5"])
    assert variants == {"base": [], "hot": ["lr=3e-3", "warmup_steps=5"]}
    specs = grid_specs(Path("o"), ["tiny-dense", "tiny-switchhead"], [5, 9], [0, 1], variants,
                       1, data="wiki-excerpt", overrides=["lr=1e-3"], scoring=Scoring())
    assert len(specs) == 16 and len({s["run_dir"] for s in specs}) == 16
    assert [s["sweep"]["steps"] for s in specs[:8]] == [5] * 8  # cheapest budget first
    hot = [s for s in specs if s["sweep"]["variant"] == "hot"]
    assert all(s["train_config"]["lr"] == 3e-3 and s["train_config"]["warmup_steps"] == 5
               for s in hot)
    assert all(s["train_config"]["lr"] == 1e-3 for s in specs if s not in hot)


def test_baseline_by_family_and_mean_se():
    assert baseline_for("repro256-moa", ["repro-dense", "repro256-dense"]) == "repro256-dense"
    assert baseline_for("repro-moa", ["repro-dense", "repro256-dense"]) == "repro-dense"
    assert baseline_for("tiny-moa", ["repro-dense"]) == "repro-dense"
    assert mean_se([2.0]) == (2.0, None)
    m, se = mean_se([1.0, 2.0, 4.0])
    assert m == pytest.approx(7 / 3) and se == pytest.approx(statistics.stdev([1, 2, 4]) / 3 ** 0.5)


def test_bad_sweep_input(tmp_path, capsys):
    assert main(["sweep", "--out", str(tmp_path / "o"), "--presets", "tiny-dense",
                 "--seeds", "x"]) == 2
    assert "--seeds expects integers" in capsys.readouterr().err
    assert main(["sweep", "--out", str(tmp_path / "o"), "--tabulate"]) == 2
    assert "holds no sweep runs" in capsys.readouterr().err


def test_interrupted_run_resumes_from_its_checkpoint(tmp_path, monkeypatch, capsys):
    from moeify.cli.main import build_parser
    from moeify.train.config import TrainConfig
    from moeify.train.trainer import train

    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(4)
    words = "one two three four five six seven".split()
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, 7))
                                                   for _ in range(200)))

    def argv(out):
        return ["sweep", "--presets", "tiny-switchhead", "--budgets", "4", "--seeds", "0",
                "--data", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / out),
                "--set", "batch_size=2", "--set", "model.d_model=32", "--set",
                "model.n_layers=2", "--set", "model.context_length=16", "--set", "eval_every=2",
                "--set", "eval_tokens=64", "--set", "log_every=1", "--set", "checkpoint_every=1",
                "--threads", "1", "--final-eval-tokens", "64"]

    # A run killed after step 2: its directory holds the sweep's spec and a checkpoint.
    args = build_parser().parse_args(argv("killed"))
    scoring = Scoring(final_eval_tokens=args.final_eval_tokens,
                      blimp_per_paradigm=args.blimp_per_paradigm, blimp_data=args.blimp_data)
    spec = grid_specs(Path(args.out), ["tiny-switchhead"], [4], [0], {"base": []}, 1,
                      data=args.data, overrides=args.overrides, scoring=scoring)[0]
    run_dir = tmp_path / "killed" / "runs" / "base" / "tiny-switchhead" / "steps-4" / "seed-0"
    run_dir.mkdir(parents=True)
    (run_dir / "compare_spec.json").write_text(json.dumps(spec))
    train(TrainConfig.from_dict(spec["train_config"]), run_dir, stop_after=2, quiet=True)
    assert main(argv("killed")) == 0
    assert "resumed base/tiny-switchhead/4/seed0" in capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text()
             .splitlines() if line.startswith('{"kind": "train"')]
    assert steps == [1, 2, 3, 4]
    # The same run uninterrupted ends with the same score.
    assert main(argv("whole")) == 0
    a = json.loads((run_dir / "compare_child.json").read_text())["final_valid"]["bpc"]
    b = json.loads((tmp_path / "whole" / "runs" / "base" / "tiny-switchhead" / "steps-4" /
                    "seed-0" / "compare_child.json").read_text())["final_valid"]["bpc"]
    assert a == pytest.approx(b, abs=1e-6)


def test_a_compare_and_a_sweep_do_not_share_an_out(swept, tmp_path, capsys):
    """Each writes OUT/results.json and results.md: a compare into a sweep's OUT (or the
    reverse) would overwrite the other's; it is refused before anything is written."""
    root, out, _, _, _ = swept
    before = (out / "results.json").read_bytes()
    assert main(["compare", "--presets", "tiny-dense", "--steps", "1", "--out", str(out),
                 "--data", str(root / "corpus.txt")]) == 2
    assert "holds a moeify sweep (its sweep.json)" in capsys.readouterr().err
    assert (out / "results.json").read_bytes() == before
    compared = tmp_path / "compared"
    (compared / "runs" / "tiny-dense").mkdir(parents=True)
    (compared / "runs" / "tiny-dense" / "compare_spec.json").write_text("{}")
    for extra in ([], ["--tabulate"]):
        assert main(["sweep", "--presets", "tiny-dense", "--out", str(compared), *extra]) == 2
        assert "holds a moeify compare (its compare_spec.json)" in capsys.readouterr().err
    assert not (compared / "sweep.json").exists()
