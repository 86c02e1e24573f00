"""moeify train / eval / generate end to end on a tiny model, and bad input as clear errors."""

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from moeify.cli.main import main

TINY = ["--set", "tokenizer=byte256", "--set", "model.d_model=32", "--set", "model.n_layers=2",
        "--set", "model.context_length=32", "--set", "model.feedforward.d_ff=64",
        "--set", "batch_size=4", "--set", "warmup_steps=0", "--set", "eval_tokens=256",
        "--set", "eval_batch_size=2", "--set", "lr=3e-3", "--quiet"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny run shared by the tests of this file (its cache and data dir beside it)."""
    tmp = tmp_path_factory.mktemp("cli")
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEIFY_CACHE_DIR", str(tmp / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = random.Random(0)
    words = ["the cat", "a dog", "sees", "likes", "the ball", "a tree", "runs", "home"]
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(6)) + "."
                                for _ in range(1200)) + "\n")
    data = tmp / "data"
    (data / "blimp").mkdir(parents=True)
    (data / "blimp" / "toy.jsonl").write_text("\n".join(json.dumps(
        {"sentence_good": g, "sentence_bad": b, "UID": "toy", "field": "syntax"})
        for g, b in [("the cat sees a dog.", "the cat see a dog."),
                     ("a dog likes the ball.", "dog a likes the ball."),
                     ("the cat runs home.", "the cats runs home.")]) + "\n")
    (data / "lambada").mkdir()
    (data / "lambada" / "lambada_test.jsonl").write_text(
        "\n".join(json.dumps({"text": t}) for t in ["the cat sees a dog", "a dog likes the ball"])
        + "\n")
    run = tmp / "run"
    code = main(["train", "--data", str(corpus), "--steps", "6", "--out", str(run), *TINY])
    assert code == 0
    yield tmp, corpus, data, run
    torch.set_num_threads(threads)
    mp.undo()


def test_train_prints_final_bpc_and_eval_ppl_reproduces_it(trained, capsys):
    tmp, corpus, data, run = trained
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000006"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["kind"] == "valid"][-1]
    assert main(["eval", "--run", str(run), "--task", "ppl", "--split", "valid", "--limit",
                 "256", "--batch-size", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["step"] == 6 and res["tokens"] == 256
    assert res["bpc"] == pytest.approx(valid["bpc"], rel=1e-6)
    assert res["bpc"] == pytest.approx(res["loss"] / math.log(2))


def test_eval_blimp_matches_log_probabilities_summed_by_hand(trained, capsys):
    tmp, corpus, data, run = trained
    assert main(["eval", "--run", str(run), "--task", "blimp", "--data-dir", str(data),
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    from moeify.rundir import load_trained

    tm = load_trained(run)

    def score(text):  # log p of every byte after the first, whole sentence in one pass
        ids = torch.tensor([list(text.encode())])
        with torch.no_grad():
            logp = F.log_softmax(tm.model(ids[:, :-1]).logits.double(), -1)
        return logp[0].gather(-1, ids[0, 1:, None]).sum().item()

    pairs = [json.loads(x) for x in (data / "blimp" / "toy.jsonl").read_text().splitlines()]
    expect = sum(score(p["sentence_good"]) > score(p["sentence_bad"]) for p in pairs) / 3
    assert res["pairs"] == 3 and res["accuracy"] == pytest.approx(expect)
    assert main(["eval", "--run", str(run), "--task", "lambada", "--data-dir", str(data)]) == 0
    assert "accuracy" in capsys.readouterr().out


def test_generate_continues_the_prompt_reproducibly(trained, capsys):
    tmp, corpus, data, run = trained
    args = ["generate", "--run", str(run), "--prompt", "the cat", "--max-new-tokens", "12",
            "--seed", "3", "--top-k", "5"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.startswith("the cat")


def test_resume_continues_the_run(trained, capsys):
    tmp, corpus, data, run = trained
    import shutil

    copy = tmp / "resumed"
    shutil.copytree(run, copy)
    assert main(["train", "--resume", str(copy), "--steps", "8", "--schedule", "stretch",
                 "--quiet"]) == 0
    assert "at step 8" in capsys.readouterr().out
    steps = [json.loads(x)["step"] for x in (copy / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 8


def _error(capsys, argv, *needles):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert "error" in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def test_bad_training_input_gives_clear_errors(trained, capsys, tmp_path):
    tmp, corpus, data, run = trained
    out = ["--out", str(tmp_path / "x")]
    _error(capsys, ["train", "--preset", "tiny-swichhead", *out], "unknown preset",
           "tiny-switchhead")
    _error(capsys, ["train", "--data", "wikipedia-full", *out, *TINY], "unknown corpus")
    _error(capsys, ["train", "--data", str(tmp / "missing.txt"), *out, *TINY], "does not exist")
    _error(capsys, ["train", "--set", "lr=fast", *out], "lr=fast", "expected a number")
    _error(capsys, ["train", "--set", "steps=2.5", *out], "expected an integer")
    _error(capsys, ["train", "--set", "model.d_model=wide", *out], "expected an integer")
    _error(capsys, ["train", "--set", "learning_rate=1", *out], "unknown setting")
    _error(capsys, ["train", "--set", "lr", *out], "key=value")
    _error(capsys, ["train", "--data", str(corpus), "--out", str(run), *TINY], "--resume")
    _error(capsys, ["train", "--resume", str(run), "--preset", "tiny-dense"], "another preset")
    _error(capsys, ["train", "--resume", str(tmp_path / "nothing")], "does not exist")


def test_bad_eval_input_gives_clear_errors(trained, capsys, tmp_path, monkeypatch):
    tmp, corpus, data, run = trained
    monkeypatch.delenv("MOEIFY_DATA_DIR", raising=False)
    _error(capsys, ["eval", "--run", str(tmp_path), "--task", "ppl"], "no complete checkpoint")
    _error(capsys, ["eval", "--run", str(run), "--task", "cbt", "--data-dir", str(data)],
           "cbt data not found")
    _error(capsys, ["eval", "--run", str(run), "--task", "lambada"], "MOEIFY_DATA_DIR")
    _error(capsys, ["generate", "--run", str(tmp_path / "nope"), "--prompt", "x"],
           "does not exist")
    _error(capsys, ["generate", "--run", str(run), "--prompt", "x", "--top-p", "2"], "top_p")
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    weights = broken / "checkpoints" / "step-00000006" / "model.safetensors"
    data_bytes = bytearray(weights.read_bytes())
    data_bytes[-10] ^= 0xFF
    weights.write_bytes(bytes(data_bytes))
    _error(capsys, ["eval", "--run", str(broken), "--task", "ppl"], "corrupt")
    _error(capsys, ["train", "--resume", str(broken), "--steps", "9", "--schedule", "stretch"],
           "corrupt")
