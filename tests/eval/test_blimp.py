"""BLiMP scoring against a word-level bigram model with hand-set probabilities."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from moeify.eval import BlimpPair, blimp_accuracy, load_blimp, score_continuations
from moeify.errors import MoeifyError

WORDS = ["the", "a", "cat", "cats", "sleeps", "sleep", "dog", "barks", "bark", "."]


class WordTokenizer:
    """Whitespace words as tokens (enough for a model whose probabilities the test writes)."""

    vocab_size = len(WORDS)

    def encode(self, text):
        return [WORDS.index(w) for w in text.split()]

    def decode(self, ids):
        return " ".join(WORDS[i] for i in ids)


# p(next | previous) for the transitions the sentences use; the rest of each row is spread
# uniformly over the other words.
P = {
    ("the", "cat"): 0.5, ("the", "cats"): 0.2, ("a", "cat"): 0.01,
    ("cat", "sleeps"): 0.6, ("cat", "sleep"): 0.1,
    ("cats", "sleep"): 0.3, ("cats", "sleeps"): 0.4,
    ("dog", "barks"): 0.25, ("dog", "bark"): 0.25,
    ("the", "dog"): 0.1,
}


def bigram_table() -> torch.Tensor:
    V = len(WORDS)
    p_VV = torch.zeros(V, V, dtype=torch.float64)
    for prev in range(V):
        fixed = {WORDS.index(b): p for (a, b), p in P.items() if a == WORDS[prev]}
        rest = (1 - sum(fixed.values())) / (V - len(fixed))
        for nxt in range(V):
            p_VV[prev, nxt] = fixed.get(nxt, rest)
    return p_VV.log()


LOGP_VV = bigram_table()


def model(ids_BT):
    return LOGP_VV[ids_BT]


def test_sentence_scores_are_summed_log_probs_after_the_first_token():
    tok = WordTokenizer()
    s = score_continuations(model, [(tok.encode("the")[:1], tok.encode("cat sleeps"))],
                            greedy=True)[0]
    assert s.total == pytest.approx(math.log(0.5) + math.log(0.6), abs=1e-12)
    assert s.logprobs.tolist() == pytest.approx([math.log(0.5), math.log(0.6)], abs=1e-12)
    assert s.greedy == [WORDS.index("cat"), WORDS.index("sleeps")]


def test_accuracy_is_the_mean_over_paradigms_and_fields():
    pairs = [
        # agreement (morphology): log .5 + log .6 > log .5 + log .1 -> correct
        BlimpPair("the cat sleeps", "the cat sleep", "agreement", "morphology"),
        # log .2 + log .3 < log .2 + log .4 -> the model prefers the bad sentence: wrong
        BlimpPair("the cats sleep", "the cats sleeps", "agreement", "morphology"),
        # the first word is not scored: p(cat | a) = .01 < p(cat | the) = .5 would not matter if it
        # were, but here the pair differs only after it: log .01 + log .6 vs log .01 + log .1
        BlimpPair("a cat sleeps", "a cat sleep", "determiner", "morphology"),
        # log .1 + log .25 == log .1 + log .25: a tie is not a success
        BlimpPair("the dog barks", "the dog bark", "island", "syntax"),
    ]
    out = blimp_accuracy(model, WordTokenizer(), pairs, batch_size=3)
    assert out["paradigms"] == {"agreement": 0.5, "determiner": 1.0, "island": 0.0}
    assert out["accuracy"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert out["fields"] == {"morphology": pytest.approx(0.75), "syntax": 0.0}
    assert out["pairs"] == 4


def test_scores_are_not_length_normalised():
    # Summed: log .5 > log .5 + log .6, so the shorter good sentence wins. Mean log-probability
    # would prefer the bad one (-0.69 < -0.60).
    out = blimp_accuracy(model, WordTokenizer(), [BlimpPair("the cat", "the cat sleeps", "p", "f")])
    assert out["accuracy"] == 1.0


def test_sentences_are_split_after_their_first_token():
    from moeify.eval.blimp import sentence_items

    tok = WordTokenizer()
    assert sentence_items(tok, ["the cat sleeps"]) == [([0], [2, 4])]
    with pytest.raises(MoeifyError, match="fewer than two tokens"):
        sentence_items(tok, ["cat"])


def _write_paradigm(root: Path, uid: str, field: str, n: int) -> None:
    with open(root / f"{uid}.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"sentence_good": f"good {i}", "sentence_bad": f"bad {i}",
                                "UID": uid, "field": field, "linguistics_term": "t"}) + "\n")


def test_load_blimp(tmp_path, monkeypatch):
    root = tmp_path / "blimp"
    root.mkdir()
    _write_paradigm(root, "anaphor_gender_agreement", "morphology", 5)
    _write_paradigm(root, "wh_island", "syntax", 3)
    pairs = load_blimp(root)
    assert len(pairs) == 8 and pairs[0] == BlimpPair("good 0", "bad 0",
                                                     "anaphor_gender_agreement", "morphology")
    monkeypatch.setenv("MOEIFY_DATA_DIR", str(tmp_path))
    assert len(load_blimp(limit_per_paradigm=2)) == 4
    (root / "broken.jsonl").write_text('{"sentence_good": "x"}\n')
    with pytest.raises(MoeifyError, match="broken.jsonl:1"):
        load_blimp()
    monkeypatch.delenv("MOEIFY_DATA_DIR")
    with pytest.raises(MoeifyError, match="blimp data not found.*MOEIFY_DATA_DIR"):
        load_blimp()


def test_the_shared_blimp_release_loads(shared_data_dir):
    if not (shared_data_dir / "blimp").is_dir():
        pytest.skip(f"no blimp/ under {shared_data_dir}: set MOEIFY_DATA_DIR to the shared data "
                    "directory")
    pairs = load_blimp(limit_per_paradigm=10)
    assert len({p.paradigm for p in pairs}) == 67 and len(pairs) == 670
    assert {p.field for p in pairs} >= {"morphology", "syntax", "semantics"}
