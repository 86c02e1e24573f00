"""Perplexity / bits per character against a bigram model whose log-probabilities are known."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moeify.data.tokenizers import ByteTokenizer
from moeify.eval import perplexity, perplexity_of_text


def bigram_model(V: int, seed: int = 0):
    """logits_fn whose rows are normalised log-probabilities log p(next | previous token)."""
    g = torch.Generator().manual_seed(seed)
    logp_VV = torch.log_softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * 2, dim=-1)
    return (lambda ids_BT: logp_VV[ids_BT]), logp_VV


def reference_nll(tokens, logp_VV) -> float:
    """Sum over every consecutive pair of -log p(next | previous), one pair at a time."""
    return sum(-float(logp_VV[a, b]) for a, b in zip(tokens[:-1], tokens[1:]))


@pytest.mark.parametrize("batch_size,seq_len", [(1, 1000), (1, 7), (3, 5), (4, 100), (200, 3)])
def test_perplexity_matches_the_pairwise_reference(batch_size, seq_len):
    V = 11
    fn, logp = bigram_model(V)
    tokens = np.random.default_rng(1).integers(0, V, size=203).tolist()
    out = perplexity(fn, tokens, batch_size=batch_size, seq_len=seq_len)
    ref = reference_nll(tokens, logp) / 202
    assert out["tokens"] == 202
    assert out["loss"] == pytest.approx(ref, rel=1e-12)
    assert out["ppl"] == pytest.approx(math.exp(ref), rel=1e-12)
    assert out["bits_per_token"] == pytest.approx(ref / math.log(2), rel=1e-12)
    assert "bpc" not in out


def test_bits_per_character_for_bytes_and_for_text():
    fn, logp = bigram_model(256, seed=2)
    text = "bits per character, byte level: enwik8 convention."
    ids = list(text.encode())
    out = perplexity_of_text(fn, ByteTokenizer(), text, batch_size=2, seq_len=8)
    assert out["bpc"] == pytest.approx(reference_nll(ids, logp) / len(ids[1:]) / math.log(2))
    manual = perplexity(fn, ids, n_chars=10)
    assert manual["bpc"] == pytest.approx(reference_nll(ids, logp) / 10 / math.log(2))


def test_windows_are_contiguous_per_row_and_memory_is_reset_once():
    V = 50
    tokens = list(range(V)) * 2 + [1, 2, 3]     # 103 tokens -> 102 targets
    seen: list[torch.Tensor] = []
    resets = []

    def stateful(ids_BT):
        seen.append(ids_BT.clone())
        return torch.zeros(*ids_BT.shape, V, dtype=torch.float64)

    out = perplexity(stateful, tokens, batch_size=4, seq_len=10, reset_fn=lambda: resets.append(1))
    assert resets == [1]
    assert out["loss"] == pytest.approx(math.log(V))   # uniform model
    lens = [26, 26, 25, 25]                              # 102 targets over 4 rows
    starts = [0, 26, 52, 77]
    for row in range(4):
        fed = torch.cat([w[row] for w in seen])[:lens[row]].tolist()
        assert fed == tokens[starts[row]:starts[row] + lens[row]]


def test_shape_errors_are_reported():
    with pytest.raises(ValueError, match=r"shape \[B, T, V\]"):
        perplexity(lambda ids: torch.zeros(ids.shape[0], 4), [1, 2, 3])
    with pytest.raises(ValueError, match="do not match"):
        perplexity(lambda ids: torch.zeros(*ids.shape, 3), [1, 2, 7])
    with pytest.raises(ValueError, match="at least two tokens"):
        perplexity(lambda ids: ids, [1])
