"""Fixtures of the trainer tests: a private cache, one intra-op thread, a tiny corpus."""

import pytest
import torch

from references import english_corpus, word_soup_corpus


def _train_env(tmp_path, monkeypatch, write):
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path, write(tmp_path / "corpus.txt")
    torch.set_num_threads(threads)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """(tmp_path, an English-like corpus)."""
    yield from _train_env(tmp_path, monkeypatch, english_corpus)


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """(tmp_path, a word-soup corpus), for the multi-process tests."""
    yield from _train_env(tmp_path, monkeypatch, word_soup_corpus)
