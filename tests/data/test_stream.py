"""Token streams: cached memory-mapped splits and contiguous, resumable, shardable batches."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from moeify.data import load_corpus, stream
from moeify.data.stream import StreamBatcher, token_dtype, tokenize_split
from moeify.data.tokenizers import ByteTokenizer, train_sentencepiece
from moeify.errors import MoeifyError


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    rng = random.Random(0)
    words = ["river", "stone", "light", "over", "the", "hills", "42", "and", "slowly", "é"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 10))) for _ in range(800)]
    f = tmp_path / "c.txt"
    f.write_text("\n".join(lines) + "\n")
    return load_corpus(str(f))


def test_tokenize_split_is_cached_and_memory_mapped(corpus, monkeypatch):
    tok = ByteTokenizer()
    ids = tokenize_split(corpus, tok, "train")
    assert isinstance(ids, np.memmap) and ids.dtype == np.uint16
    assert ids.tolist() == list(corpus.read_bytes("train"))

    def must_not_encode(data):
        raise AssertionError("the cached token file should have been reused")

    monkeypatch.setattr(tok, "encode_array", must_not_encode)
    assert np.array_equal(tokenize_split(corpus, tok, "train"), ids)


def test_token_dtype_widens_for_large_vocabularies():
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_chunked_tokenisation_equals_whole_text(corpus, monkeypatch):
    tok = train_sentencepiece(corpus, vocab_size=330)
    monkeypatch.setattr(stream, "_CHUNK_BYTES", 200)   # dozens of chunk boundaries
    text = corpus.read_text("train")
    assert len(stream._chunks(corpus.read_bytes("train"), 200)) > 20
    assert tokenize_split(corpus, tok, "train").tolist() == tok.encode(text)


def _reference_window(tokens, B_total, T, row, step):
    L = len(tokens) // B_total
    start = row * L + step * T
    return tokens[start:start + T + 1]


def test_batches_are_contiguous_windows_of_b_streams():
    tokens = np.arange(1000, dtype=np.uint32)
    B, T = 4, 7
    b = StreamBatcher(tokens, B, T)
    assert b.steps_per_epoch == (1000 // B - 1) // T
    prev = None
    for step in range(b.steps_per_epoch):
        assert b.starts_new_pass == (step == 0)
        x = b.next()
        assert x.shape == (B, T + 1) and x.dtype == torch.long
        for row in range(B):
            assert x[row].tolist() == _reference_window(tokens, B, T, row, step).tolist()
        if prev is not None:
            # XL memory continuity: each row resumes exactly where it stopped.
            assert torch.equal(x[:, 0], prev[:, -1])
        prev = x
    assert b.starts_new_pass and b.epoch == 1
    assert b.next()[:, 0].tolist() == [row * 250 for row in range(B)]


def test_resume_reproduces_the_uninterrupted_sequence():
    tokens = np.random.default_rng(0).integers(0, 5000, size=3000).astype(np.uint16)
    full = StreamBatcher(tokens, 3, 16)
    expected = [full.next() for _ in range(150)]          # crosses an epoch boundary
    first = StreamBatcher(tokens, 3, 16)
    for _ in range(37):
        first.next()
    state = first.state_dict()
    resumed = StreamBatcher(tokens, 3, 16)
    resumed.load_state_dict(state)
    for i in range(37, 150):
        assert torch.equal(resumed.next(), expected[i])


def test_data_parallel_shards_partition_the_global_batch():
    tokens = np.arange(5000, dtype=np.uint16)
    single = StreamBatcher(tokens, 6, 10)
    ranks = [StreamBatcher(tokens, 2, 10, rank=r, world_size=3) for r in range(3)]
    for _ in range(20):
        assert torch.equal(torch.cat([r.next() for r in ranks]), single.next())
    # A position saved by a 3-process run resumes a 1-process run of the same global batch.
    resumed = StreamBatcher(tokens, 6, 10)
    resumed.load_state_dict(ranks[0].state_dict())
    assert torch.equal(resumed.next(), single.next())


def test_batcher_input_errors():
    tokens = np.arange(100, dtype=np.uint16)
    with pytest.raises(MoeifyError, match="cannot fill"):
        StreamBatcher(tokens, 8, 20)
    with pytest.raises(ValueError, match="rank 2"):
        StreamBatcher(tokens, 1, 4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="must be >= 1"):
        StreamBatcher(tokens, 0, 4)
    b = StreamBatcher(tokens, 2, 4)
    with pytest.raises(MoeifyError, match="same global batch"):
        b.load_state_dict(StreamBatcher(tokens, 2, 5).state_dict())
    bad = b.state_dict() | {"step": 10_000}
    with pytest.raises(MoeifyError, match="corrupt"):
        b.load_state_dict(bad)
