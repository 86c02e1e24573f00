"""The Children's Book Test: the official file format, and scoring on a model the test controls."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeify.data.tokenizers import ByteTokenizer
from moeify.eval import CBT_GROUPS, CBTExample, cbt_accuracy, load_cbt, parse_cbt
from moeify.eval.cbt import detokenize, example_items
from moeify.errors import MoeifyError


def official_example(query: str, answer: str, candidates: list[str], topic: str = "king") -> str:
    """One example exactly as in cbtest_*_test_2500ex.txt: 20 numbered sentences, then
    '21 query<TAB>answer<TAB><TAB>c1|...|c10', then a blank line."""
    lines = [f"{i} The {topic} , who was old , said `` hello '' to sentence {i} ."
             for i in range(1, 21)]
    lines.append(f"21 {query}\t{answer}\t\t{'|'.join(candidates)}")
    return "\n".join(lines) + "\n\n"


CANDS = ["abc", "bed", "cab", "dab", "ebb", "fad", "gab", "hag", "jab", "qqq"]


def test_parse_the_official_format():
    text = (official_example("the XXXXX went home .", "qqq", CANDS)
            + official_example("`` I 'll see the XXXXX , '' she said .", "bed", CANDS, "queen"))
    exs = parse_cbt(text)
    assert len(exs) == 2
    ex = exs[1]
    assert len(ex.context) == 20
    assert ex.context[0] == "The queen , who was old , said `` hello '' to sentence 1 ."
    assert ex.query == "`` I 'll see the XXXXX , '' she said ."
    assert ex.answer == "bed" and ex.candidates == tuple(CANDS)


@pytest.mark.parametrize("bad,message", [
    ("1 one\n21 no tabs at all\n", r"sample:2: the query line must be"),
    ("1 one\n21 the XXXXX\tzzz\t\ta|b\n", r"sample:2: the answer 'zzz' is not among"),
    ("1 one\n21 no blank here\ta\t\ta|b\n", r"sample:2: the query has no XXXXX"),
    ("one\n21 the XXXXX\ta\t\ta|b\n", r"sample:1: expected a numbered line"),
    ("1 one\n3 three\n4 the XXXXX\ta\t\ta|b\n", r"sample:1: lines must be numbered 1..3"),
])
def test_malformed_files_name_the_line(bad, message):
    with pytest.raises(MoeifyError, match=message):
        parse_cbt(bad, source="sample")


def test_detokenize_undoes_ptb_spacing():
    assert detokenize("He said , `` no ! '' and did n't go .") == 'He said, "no!" and didn\'t go.'


def test_prefix_and_continuation_text():
    ex = parse_cbt(official_example("`` Look at the XXXXX , '' he said .", "bed", CANDS))[0]
    tok = ByteTokenizer()
    items = example_items(tok, ex)
    assert len(items) == 10
    prefix_ids, cont_ids = items[1]
    context = " ".join(detokenize(s) for s in ex.context)
    # The space before the blank starts the continuation.
    assert tok.decode(prefix_ids) == context + ' "Look at the'
    assert tok.decode(cont_ids) == ' bed," he said.'
    assert all(p == prefix_ids for p, _ in items)


# A model that ignores its input: every position predicts the same byte distribution, with
# 'z' and 'q' far likelier than other bytes.
WEIGHTS = torch.ones(256, dtype=torch.float64)
WEIGHTS[ord("z")], WEIGHTS[ord("q")] = 300.0, 40.0
LOGP_V = (WEIGHTS / WEIGHTS.sum()).log()


def unigram_model(ids_BT):
    return LOGP_V.expand(*ids_BT.shape, 256)


def hand_score(candidate: str, after: str) -> float:
    """Mean log-probability of the continuation bytes ' ' + candidate + rest of the query."""
    cont = (" " + candidate + after).encode()
    return sum(float(LOGP_V[b]) for b in cont) / len(cont)


def test_scores_are_length_normalised_means():
    # Mean: ' zzzzzzzz .' beats ' z .' (more of its bytes are likely); a sum would prefer the
    # shorter continuation.
    long, short = hand_score("zzzzzzzz", " ."), hand_score("z", " .")
    assert long > short
    sum_long = hand_score("zzzzzzzz", " .") * len(" zzzzzzzz .")
    assert sum_long < hand_score("z", " .") * len(" z .")
    ex = CBTExample(context=("a .",) * 20, query="the XXXXX .", answer="zzzzzzzz",
                    candidates=("z", "zzzzzzzz", "abc"))
    assert cbt_accuracy(unigram_model, ByteTokenizer(), {"P": [ex]})["accuracy"] == 1.0


def test_accuracy_is_the_mean_over_groups(tmp_path):
    def ex(answer, cands):
        return CBTExample(context=("It was a dark night .",) * 20, query="she saw the XXXXX .",
                          answer=answer, candidates=tuple(cands))

    groups = {
        "CN": [ex("zzq", ["zzq", "abc", "qqa", "bbb"])],                 # gold highest: right
        "NE": [ex("abc", ["zzq", "abc", "qqa", "bbb"])],                 # gold not highest
        "P": [ex("qqa", ["abc", "qqa", "bbb"]), ex("bbb", ["bbb", "qqq"])],  # right, wrong
        "V": [ex("abc", ["abc", "cba"])],                                # a tie is not a success
    }
    # The hand-written expectation, from the unigram table.
    for g, exs in groups.items():
        for e in exs:
            scores = {c: hand_score(c, " .") for c in e.candidates}
            strictly_best = all(scores[e.answer] > v for c, v in scores.items() if c != e.answer)
            assert strictly_best == (g == "CN" or e.answer == "qqa")
    out = cbt_accuracy(unigram_model, ByteTokenizer(), groups, batch_size=4)
    assert out["groups"] == {"CN": 1.0, "NE": 0.0, "P": 0.5, "V": 0.0}
    assert out["accuracy"] == pytest.approx(1.5 / 4)
    assert out["n"] == 5


def test_no_groups_is_a_clear_error():
    with pytest.raises(ValueError, match="at least one group"):
        cbt_accuracy(unigram_model, ByteTokenizer(), {})


def _write_group_files(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for g in CBT_GROUPS:
        (root / f"cbtest_{g}_test_2500ex.txt").write_text(
            official_example(f"the XXXXX of {g} .", "qqq", CANDS) * 3)


def test_load_cbt_from_path_and_data_dir(tmp_path, monkeypatch):
    _write_group_files(tmp_path / "release" / "CBTest" / "data")
    data = load_cbt(tmp_path / "release")
    assert set(data) == set(CBT_GROUPS) and all(len(v) == 3 for v in data.values())
    assert data["NE"][0].query == "the XXXXX of NE ."
    _write_group_files(tmp_path / "cbt")
    monkeypatch.setenv("MOEIFY_DATA_DIR", str(tmp_path))
    assert len(load_cbt(groups=("CN",), limit=2)["CN"]) == 2
    (tmp_path / "cbt" / "cbtest_V_test_2500ex.txt").unlink()
    with pytest.raises(MoeifyError, match="cbtest_V_test_2500ex.txt not found"):
        load_cbt()
    with pytest.raises(ValueError, match="unknown CBT group"):
        load_cbt(groups=("XX",))
    monkeypatch.delenv("MOEIFY_DATA_DIR")
    with pytest.raises(MoeifyError, match="cbt data not found.*MOEIFY_DATA_DIR"):
        load_cbt()
