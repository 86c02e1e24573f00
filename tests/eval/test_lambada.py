"""LAMBADA scoring against a byte-level model whose greedy predictions the test dictates."""

from __future__ import annotations

import json

import pytest
import torch

from moeify.data.tokenizers import ByteTokenizer
from moeify.eval import lambada_accuracy, load_lambada
from moeify.eval.lambada import split_passage
from moeify.errors import MoeifyError

# The model's argmax next byte after each byte; any other byte is followed by a space.
NEXT = {" ": "c", "c": "a", "a": "t", "t": " "}


def next_char_model(ids_BT: torch.Tensor) -> torch.Tensor:
    logits_V256 = torch.zeros(256, 256, dtype=torch.float64)
    logits_V256[:, ord(" ")] = 1.0
    for a, b in NEXT.items():
        logits_V256[ord(a)] = 0.0
        logits_V256[ord(a), ord(b)] = 1.0
    return logits_V256[ids_BT]


# passage -> the word the model predicts (worked out by hand from NEXT, teacher-forced over the
# target " word": the prediction after the context's last byte, then after each target byte but
# the last).
CASES = {
    "the cat": "cat",        # e->' ', ' '->c, c->a, a->t: " cat" (correct)
    "a cot": "tca",          # a->t, ' '->c, c->a, o->' ': "tca " (wrong)
    "xyz ca": "ca",          # z->' ', ' '->c, c->a: " ca" (correct)
    "hello cat.": "cat",     # o->' ', ' '->c, c->a, a->t, t->' ': " cat " vs "cat." (wrong)
}


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_accuracy_equals_the_hand_computed_predictions(batch_size):
    out = lambada_accuracy(next_char_model, ByteTokenizer(), list(CASES), batch_size=batch_size,
                           return_predictions=True)
    assert out["predictions"] == list(CASES.values())
    assert out["correct"] == 2 and out["n"] == 4 and out["accuracy"] == 0.5


def test_context_truncation_keeps_the_target():
    # Only the last byte of the context matters to this model, so a short window changes nothing.
    texts = ["a long context before the cat", "something else: a cot"]
    full = lambada_accuracy(next_char_model, ByteTokenizer(), texts, return_predictions=True)
    short = lambada_accuracy(next_char_model, ByteTokenizer(), texts, max_len=6,
                             return_predictions=True)
    assert full == short and full["predictions"] == ["cat", "tca"]
    with pytest.raises(MoeifyError, match="does not fit"):
        lambada_accuracy(next_char_model, ByteTokenizer(), texts, max_len=3)


def test_no_passages_is_a_clear_error():
    with pytest.raises(ValueError, match="at least one passage"):
        lambada_accuracy(next_char_model, ByteTokenizer(), [])


def test_split_passage():
    assert split_passage("He said hello  there\n") == ("He said hello", "  there", "there")
    with pytest.raises(MoeifyError, match="context and a last word"):
        split_passage("alone")


def test_load_lambada_from_path_and_data_dir(tmp_path, monkeypatch):
    lam = tmp_path / "lambada"
    lam.mkdir()
    (lam / "lambada_test.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in CASES))
    assert load_lambada(lam / "lambada_test.jsonl") == list(CASES)
    monkeypatch.setenv("MOEIFY_DATA_DIR", str(tmp_path))
    assert load_lambada(limit=2) == list(CASES)[:2]
    (lam / "lambada_test.jsonl").write_text('{"txt": "x"}\n')
    with pytest.raises(MoeifyError, match="lambada_test.jsonl:1: not a LAMBADA JSON line"):
        load_lambada()


def test_missing_data_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv("MOEIFY_DATA_DIR", raising=False)
    with pytest.raises(MoeifyError, match="MOEIFY_DATA_DIR"):
        load_lambada()
    monkeypatch.setenv("MOEIFY_DATA_DIR", str(tmp_path))
    with pytest.raises(MoeifyError, match="has no lambada/lambada_test.jsonl"):
        load_lambada()
    with pytest.raises(MoeifyError, match="not found at"):
        load_lambada(tmp_path / "nope.jsonl")


def test_the_shared_lambada_test_set_loads(shared_data_dir):
    if not (shared_data_dir / "lambada" / "lambada_test.jsonl").is_file():
        pytest.skip(f"no lambada/lambada_test.jsonl under {shared_data_dir}: set MOEIFY_DATA_DIR "
                    "to the shared data directory")
    texts = load_lambada()
    assert len(texts) == 5153
    assert all(len(split_passage(t)[2]) > 0 for t in texts)
