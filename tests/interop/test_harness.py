"""The lm-evaluation-harness model type `moeify` and `moeify eval --harness`, on a tiny trained run.

References: log-likelihoods summed by hand from one unpadded forward per item; `moeify eval`'s
own LAMBADA and BLiMP numbers on the same items.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moeify.cli.main import main
from moeify.errors import MoeifyError
from harness_env import harness_offline

TINY = ["--set", "tokenizer=byte256", "--set", "model.d_model=32", "--set", "model.n_layers=2",
        "--set", "model.context_length=32", "--set", "model.feedforward.d_ff=64",
        "--set", "batch_size=8", "--set", "warmup_steps=0", "--set", "eval_tokens=256",
        "--set", "eval_batch_size=2", "--set", "lr=3e-3", "--quiet"]
PARADIGMS = ["anaphor_number_agreement", "determiner_noun_agreement_2", "wh_island"]


@pytest.fixture(scope="module", autouse=True)
def keep_global_rng():
    """Training and sampling here draw from torch's global generator; the files after this one
    get it back as they would have found it."""
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


def test_a_missing_extra_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "DISABLE_MULTIPROC"):
        monkeypatch.setenv(k, "1")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` sees without it
    monkeypatch.delitem(sys.modules, "moeify.interop.harness", raising=False)
    with pytest.raises(MoeifyError, match=r"pip install -e '\.\[harness\]' in the moeify checkout"):
        import moeify.interop.harness  # noqa: F401
    assert main(["eval", "--run", str(tmp_path), "--harness", "moeify_lambada"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install -e '.[harness]'" in err


@pytest.fixture(scope="module")
def harness():
    pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install "
                        "-e '.[harness]' (make test installs it)")
    import moeify.interop.harness

    return moeify.interop.harness


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny SwitchHead (XL memory, byte tokens) trained for 40 steps on toy English."""
    tmp = tmp_path_factory.mktemp("harness")
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEIFY_CACHE_DIR", str(tmp / "cache"))
    harness_offline(mp, tmp)  # the datasets cache and offline switches stay inside this module
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = random.Random(0)
    subjects = ["the cat", "a dog", "the girls", "some boys", "the teacher", "this woman"]
    verbs = ["sees", "likes", "helped", "was talking to", "found", "has visited"]
    objects = ["the ball", "a tree", "herself", "themselves", "the house", "those books"]
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(f"{rng.choice(subjects)} {rng.choice(verbs)} "
                                f"{rng.choice(objects)}." for _ in range(3000)) + "\n")
    run = tmp / "run"
    assert main(["train", "--data", str(corpus), "--steps", "40", "--out", str(run), *TINY]) == 0
    yield run
    torch.set_num_threads(threads)
    mp.undo()


@pytest.fixture(scope="module")
def lm(harness, run_dir):
    # the registered type, built the way lm-eval builds it from --model_args
    from lm_eval.api.registry import get_model

    return get_model("moeify").create_from_arg_string(f"run={run_dir},batch_size=3,device=cpu")


def by_hand(model, prefix, cont, max_len):
    """Summed log p of ``cont`` after ``prefix`` and whether each token is the argmax: one
    unpadded forward, the input cut from the left to ``max_len`` tokens (None: whole)."""
    ids = [*prefix, *cont]
    inp = ids[:-1] if max_len is None else ids[:-1][-max_len:]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([inp])).logits[0].double(), -1)[-len(cont):]
    tgt = torch.tensor(cont)
    return logp.gather(-1, tgt[:, None]).sum().item(), logp.argmax(-1).tolist() == cont


def requests(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def test_loglikelihood_equals_scoring_by_hand(lm):
    tok, model = lm.tokenizer, lm.model
    assert lm.max_len == 64  # context 32, XL memory: twice that without memory
    long_ctx = ("the cat sees the ball and a dog likes a tree. " * 3).rstrip()
    args = [("the cat sees", " the ball."), ("a dog", " likes"), (long_ctx, " the house."),
            ("the girls helped ", "themselves."), ("", "the teacher found a tree."),
            ("", "some boys " * 9 + "found a tree.")]  # longer than the context: scored whole
    got = lm.loglikelihood(requests("loglikelihood", args))
    enc = tok.encode
    expect = [by_hand(model, enc("the cat sees"), enc(" the ball."), 64),
              by_hand(model, enc("a dog"), enc(" likes"), 64),
              by_hand(model, enc(long_ctx), enc(" the house."), 64),
              by_hand(model, enc("the girls helped"), enc(" themselves."), 64),
              by_hand(model, enc("t"), enc("he teacher found a tree."), 64),
              by_hand(model, enc("s"), enc(("some boys " * 9 + "found a tree.")[1:]), None)]
    assert len(enc(long_ctx)) > 64 and len(enc(args[-1][1])) > 65
    for (ll, greedy), (ll_ref, greedy_ref) in zip(got, expect):
        assert ll == pytest.approx(ll_ref, abs=1e-5) and greedy == greedy_ref
    assert any(g for _, g in got[:2]) or all(not g for _, g in expect[:2])


def test_requests_report_their_progress(lm):
    seen = []
    lm.progress = lambda label, done, total: seen.append((label, done, total))
    try:
        lm.loglikelihood(requests("loglikelihood", [("the cat", " sees")] * 4))
        lm.generate_until(requests("generate_until", [("the cat", {"max_gen_toks": 2})] * 2))
    finally:
        lm.progress = None
    assert seen == [("log-likelihoods", 3, 4), ("log-likelihoods", 4, 4),
                    ("generations", 1, 2), ("generations", 2, 2)]


def test_loglikelihood_matches_moeify_blimp_and_lambada_scoring(lm):
    from moeify.eval.blimp import sentence_items
    from moeify.eval.lambada import split_passage
    from moeify.eval.scoring import score_continuations

    passages = ["the teacher found the house.\nthe cat sees a tree", "a dog likes those books"]
    sentences = ["this woman has visited the house.", "the girls helped themselves."]
    got = lm.loglikelihood(requests("loglikelihood", [split_passage(p)[:2] for p in passages] +
                                    [("", s) for s in sentences]))
    tok = lm.tokenizer
    ref = score_continuations(lm.logits_fn, [(tok.encode(c), tok.encode(t)) for c, t, _ in
                                             map(split_passage, passages)], max_len=64,
                              greedy=True)
    ref += score_continuations(lm.logits_fn, sentence_items(tok, sentences))
    for (ll, _), r in zip(got, ref):
        assert ll == pytest.approx(r.total, abs=1e-5)


def test_rolling_loglikelihood_scores_every_token_after_the_first_once(lm):
    text = "the cat sees the ball. a dog likes a tree. " * 4   # 172 tokens: three windows
    ids = lm.tokenizer.encode(text)
    items = lm.rolling_items(text)
    assert [t for _, cont in items for t in cont] == ids[1:]
    assert all(len(p) + len(c) - 1 <= lm.max_len for p, c in items) and len(items) == 3
    expect = sum(by_hand(lm.model, p, c, None)[0] for p, c in items)
    short = "a dog likes a tree."
    got = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,), (short,), ("a",)]))
    assert got[0] == pytest.approx(expect, abs=1e-5)
    short_ids = lm.tokenizer.encode(short)
    assert got[1] == pytest.approx(by_hand(lm.model, short_ids[:1], short_ids[1:], None)[0],
                                   abs=1e-5)
    assert got[2] == 0.0   # one token: nothing is predicted


def test_generate_until_stops_at_the_until_strings(lm):
    calls = []
    hook = lm.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        free = lm.generate_until(requests("generate_until", [("the cat", {"max_gen_toks": 40})]))[0]
        assert len(calls) == 40 and len(free) >= 12   # prefill + 39 decoding steps
        stop = free[10:12]
        first = free.index(stop)
        calls.clear()
        other = free[first + 1:first + 3]
        cut = lm.generate_until(requests("generate_until", [
            ("the cat", {"until": [stop], "max_gen_toks": 40}),
            ("the cat", {"until": ["\u2603", other, stop], "max_gen_toks": 40})]))
    finally:
        hook.remove()
    assert cut[0] == free[:first]
    # the earliest of the stop strings that occur
    assert cut[1] == free[:min(free.index(other), first)]
    # each generation ended once its stop string appeared: not 40 forwards each
    assert len(calls) <= 2 * (first + len(stop))


def test_unknown_task_is_a_one_line_error_and_writes_nothing(harness, run_dir, capsys):
    assert main(["eval", "--run", str(run_dir), "--harness", "moeify_lambada,no_such_task",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown harness task no_such_task" in err
    assert "--harness-include" in err and not (run_dir / "harness").exists()
    for args in (["--harness", "moeify_lambada", "--task", "lambada"], [],
                 ["--task", "blimp", "--harness-out", str(run_dir / "harness" / "x.json")]):
        assert main(["eval", "--run", str(run_dir), *args]) == 2
        assert capsys.readouterr().err.count("\n") == 1
    assert not (run_dir / "harness").exists()


def test_a_users_local_tasks_through_harness_include(harness, run_dir, tmp_path, monkeypatch,
                                                     capsys):
    """The harness guide's two recipes (docs/guide/harness.md): datasets' json builder on an absolute path, and local_json on a
    path under $MOEIFY_DATA_DIR."""
    (tmp_path / "mine").mkdir()
    pairs = [("the cat sees a tree.", "the cat see a tree."),
             ("the girls helped themselves.", "the girls helped himself."),
             ("a dog likes the ball.", "a dog like the ball.")]
    for name, chosen in (("pairs.jsonl", pairs[:2]), ("mine/more.jsonl", pairs)):
        (tmp_path / name).write_text("".join(json.dumps({"good": g, "bad": b}) + "\n"
                                             for g, b in chosen))
    body = ("test_split: test\noutput_type: multiple_choice\ndoc_to_text: ''\n"
            "target_delimiter: ''\ndoc_to_choice: '{{[good, bad]}}'\ndoc_to_target: 0\n"
            "metric_list:\n  - metric: acc\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "my_pairs.yaml").write_text(
        "task: my_pairs\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'pairs.jsonl'}\n" + body)
    (tasks / "utils.py").write_text("from moeify.interop.harness_data import local_json\n")
    (tasks / "my_more.yaml").write_text(
        "task: my_more\ncustom_dataset: !function utils.local_json\ndataset_kwargs:\n"
        "  data_files:\n    test: mine/more.jsonl\n" + body)
    # and a bundled task on a data directory of the user's: a BLiMP paradigm file with a pair
    # whose sentences are identical (the release has 7): a tie is not a success for either
    (tmp_path / "blimp").mkdir()
    (tmp_path / "blimp" / "wh_island.jsonl").write_text("".join(
        json.dumps({"sentence_good": g, "sentence_bad": b, "UID": "wh_island"}) + "\n"
        for g, b in [*pairs, (pairs[0][0], pairs[0][0])]))
    monkeypatch.setenv("MOEIFY_DATA_DIR", str(tmp_path / "elsewhere"))
    out = tmp_path / "res.json"
    assert main(["eval", "--run", str(run_dir), "--harness", "my_pairs,my_more,"
                 "moeify_blimp_wh_island", "--harness-include", str(tasks), "--harness-out",
                 str(out), "--data-dir", str(tmp_path), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert "my_pairs" in printed and "my_more" in printed
    assert main(["eval", "--run", str(run_dir), "--task", "blimp", "--data",
                 str(tmp_path / "blimp"), "--json"]) == 0
    blimp = json.loads(capsys.readouterr().out)
    assert res["results"]["moeify_blimp_wh_island"]["acc,none"] == blimp["accuracy"]
    from moeify.rundir import load_trained

    tm = load_trained(run_dir)
    enc = tm.tokenizer.encode
    right = [by_hand(tm.model, enc(g)[:1], enc(g)[1:], None)[0] >
             by_hand(tm.model, enc(b)[:1], enc(b)[1:], None)[0] for g, b in pairs]
    assert res["n-samples"]["my_pairs"]["effective"] == 2
    assert res["results"]["my_pairs"]["acc,none"] == sum(right[:2]) / 2
    assert res["n-samples"]["my_more"]["effective"] == 3
    assert res["results"]["my_more"]["acc,none"] == pytest.approx(sum(right) / 3)
    assert blimp["accuracy"] == pytest.approx(sum(right) / 4)


def test_the_bundled_blimp_group_lists_every_paradigm(harness, shared_data_dir):
    import yaml

    TASKS_DIR = harness.TASKS_DIR
    group = yaml.safe_load((TASKS_DIR / "_moeify_blimp.yaml").read_text())
    assert group["group"] == "moeify_blimp"
    assert group["aggregate_metric_list"] == [{"metric": "acc", "aggregation": "mean",
                                               "weight_by_size": False}]
    names = [t.removeprefix("moeify_blimp_") for t in group["task"]]
    assert len(names) == 67
    for n in names:
        cfg = yaml.safe_load((TASKS_DIR / f"moeify_blimp_{n}.yaml").read_text())
        assert cfg["task"] == f"moeify_blimp_{n}"
        assert cfg["dataset_kwargs"]["data_files"]["test"] == f"blimp/{n}.jsonl"
    if not (shared_data_dir / "blimp").is_dir():
        pytest.skip(f"no blimp/ under {shared_data_dir}: set MOEIFY_DATA_DIR to the shared data")
    assert sorted(names) == sorted(p.stem for p in (shared_data_dir / "blimp").glob("*.jsonl"))


def test_harness_lambada_and_blimp_agree_with_moeify_eval(harness, run_dir, shared_data_dir,
                                                          tmp_path, capsys):
    for need in ["lambada/lambada_test.jsonl", *(f"blimp/{p}.jsonl" for p in PARADIGMS)]:
        if not (shared_data_dir / need).is_file():
            pytest.skip(f"no {need} under {shared_data_dir}: set MOEIFY_DATA_DIR to the shared "
                        "data directory")
    n = 50
    harness = ",".join(["moeify_lambada", *(f"moeify_blimp_{p}" for p in PARADIGMS)])
    assert main(["eval", "--run", str(run_dir), "--harness", harness, "--limit", str(n),
                 "--device", "cpu", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["results"]
    written = next((run_dir / "harness").glob("*.json"))
    assert json.loads(written.read_text())["results"] == res

    sub = tmp_path / "blimp"
    sub.mkdir()
    for p in PARADIGMS:
        (sub / f"{p}.jsonl").symlink_to(shared_data_dir / "blimp" / f"{p}.jsonl")
    assert main(["eval", "--run", str(run_dir), "--task", "blimp", "--data", str(sub),
                 "--limit", str(n), "--device", "cpu", "--json"]) == 0
    blimp = json.loads(capsys.readouterr().out)
    for p in PARADIGMS:
        assert res[f"moeify_blimp_{p}"]["acc,none"] == blimp["paradigms"][p]
    assert len(set(blimp["paradigms"].values())) > 1   # the tiny model does tell pairs apart

    assert main(["eval", "--run", str(run_dir), "--task", "lambada", "--limit", str(n),
                 "--device", "cpu", "--json"]) == 0
    lam = json.loads(capsys.readouterr().out)
    # Same items, same log-likelihoods; the harness counts a passage when every target token is
    # the argmax, moeify when the last word of the decoded argmax tokens is the gold word.
    from moeify.eval.lambada import load_lambada, split_passage
    from moeify.eval.adapters import stateless_logits_fn
    from moeify.eval.scoring import score_continuations
    from moeify.rundir import load_trained

    tm = load_trained(run_dir)
    items = [(tm.tokenizer.encode(c), tm.tokenizer.encode(t))
             for c, t, _ in map(split_passage, load_lambada(limit=n))]
    scores = score_continuations(stateless_logits_fn(tm.model, torch.device("cpu")), items,
                                 max_len=64, greedy=True)
    exact = sum(s.greedy == cont for s, (_, cont) in zip(scores, items))
    assert res["moeify_lambada"]["acc,none"] == exact / n and lam["n"] == n
    assert exact <= lam["correct"]
    mean_ll = sum(s.total for s in scores) / n
    assert res["moeify_lambada"]["perplexity,none"] == pytest.approx(math.exp(-mean_ll),
                                                                     rel=1e-6)


def test_a_run_that_cannot_be_written_gets_its_results_printed_then_saved_elsewhere(
        harness, run_dir, tmp_path, monkeypatch, capsys):
    """The evaluation is not thrown away: the table is printed before anything is written, and
    the JSON goes to a named writable place (the current directory) when RUN/harness cannot be
    written (a read-only run; made deterministic by a writer that refuses the run directory)."""
    import errno

    import moeify.data.cache as cache

    real = cache.write_bytes_atomic

    def read_only_run(path, data):
        if Path(run_dir) in Path(path).parents:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, data)

    monkeypatch.setattr(cache, "write_bytes_atomic", read_only_run)
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"good": "the cat sees a tree.",
                                                      "bad": "the cat see a tree."}) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "my_pairs.yaml").write_text(
        "task: my_pairs\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'pairs.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: ''\ntarget_delimiter: ''\ndoc_to_choice: '{{[good, bad]}}'\n"
        "doc_to_target: 0\nmetric_list:\n  - metric: acc\n")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["eval", "--run", str(run_dir), "--harness", "my_pairs", "--harness-include",
                 str(tasks), "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    written = list(here.glob(f"harness-{Path(run_dir).name}-*-my_pairs.json"))
    assert len(written) == 1 and "my_pairs" in captured.out and "acc" in captured.out
    assert captured.out.index("my_pairs") < captured.out.index(f"wrote {written[0]}")
    assert "could not be written into the run" in captured.err
    assert "the file system is read-only" in captured.err and "--harness-out FILE" in captured.err
    assert json.loads(written[0].read_text())["results"]["my_pairs"]["acc,none"] in (0.0, 1.0)
    # The user's own --harness-out is not replaced: its error, after the printed table.
    assert main(["eval", "--run", str(run_dir), "--harness", "my_pairs", "--harness-include",
                 str(tasks), "--device", "cpu", "--harness-out",
                 str(Path(run_dir) / "mine.json")]) == 2
    captured = capsys.readouterr()
    assert "my_pairs" in captured.out and "the file system is read-only" in captured.err
