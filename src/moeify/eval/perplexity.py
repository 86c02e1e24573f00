"""Perplexity and bits per character over a whole split.

Shape legend: B streams evaluated side by side, T tokens per window, V vocabulary.

Perplexity = exp(mean token cross-entropy); bits per character = mean cross-entropy / ln 2 per
character, where for byte-level models a character is a byte (the enwik8 convention). Every token
after the first is predicted exactly once: the N - 1 targets are cut
into B contiguous stretches (lengths differ by at most one) and read window by window, so a
stateful ``logits_fn`` that carries XL memory between calls sees each stream continuously.
``reset_fn`` (optional) is called once before the first window to clear such memory.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from moeify.eval.scoring import LogitsFn, check_logits, upcast


@torch.no_grad()
def perplexity(logits_fn: LogitsFn, tokens, *, tokenizer=None, batch_size: int = 1,
               seq_len: int = 512, n_chars: int | None = None,
               reset_fn: Callable[[], None] | None = None,
               progress: Callable[[int, int], None] | None = None) -> dict:
    """Score a 1-D token sequence (array, memmap, list or tensor).

    Returns ``tokens`` (targets scored), ``loss`` (mean nats/token), ``ppl``,
    ``bits_per_token`` and, when ``n_chars`` is given or the tokenizer is byte-level, ``bpc``."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be >= 1")
    tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    n_targets = tokens.numel() - 1
    if n_targets < 1:
        raise ValueError("perplexity needs at least two tokens")
    B = min(batch_size, n_targets)
    # Row b predicts targets [start_B[b], start_B[b] + len_B[b]) of the sequence.
    len_B = torch.full((B,), n_targets // B, dtype=torch.long)
    len_B[: n_targets % B] += 1
    start_B = 1 + torch.cumsum(len_B, 0) - len_B
    if reset_fn is not None:
        reset_fn()
    total_nll = torch.zeros((), dtype=torch.float64)
    max_id = int(tokens.max())
    longest = int(len_B[0])
    scored = 0
    for offset in range(0, longest, seq_len):
        T = min(seq_len, longest - offset)
        pos_T = torch.arange(T)
        mask_BT = pos_T[None, :] < (len_B - offset)[:, None]
        tgt_idx_BT = torch.where(mask_BT, start_B[:, None] + offset + pos_T[None, :], 1)
        tgt_BT = tokens[tgt_idx_BT]
        ids_BT = torch.where(mask_BT, tokens[tgt_idx_BT - 1], 0)
        logits_BTV = logits_fn(ids_BT)
        check_logits(logits_BTV, B, T, max_id)
        nll_BT = F.cross_entropy(upcast(logits_BTV).flatten(0, 1),
                                 tgt_BT.flatten().to(logits_BTV.device), reduction="none")
        total_nll += nll_BT.view(B, T).cpu().double().masked_fill(~mask_BT, 0.0).sum()
        if progress is not None:
            scored += int(mask_BT.sum())
            progress(scored, n_targets)
    loss = float(total_nll) / n_targets
    out = {"tokens": n_targets, "loss": loss, "ppl": math.exp(loss) if loss < 700 else math.inf,
           "bits_per_token": loss / math.log(2)}
    if n_chars is None and tokenizer is not None and getattr(tokenizer, "byte_level", False):
        n_chars = n_targets
    if n_chars is not None:
        out["bpc"] = float(total_nll) / math.log(2) / n_chars
    return out


def perplexity_of_text(logits_fn: LogitsFn, tokenizer, text: str, **kwargs) -> dict:
    """``perplexity`` of ``text`` tokenised by ``tokenizer``; bpc counts the characters after the
    first token (those the model predicts) for byte-level tokenizers, else all characters."""
    ids = tokenizer.encode(text)
    if not getattr(tokenizer, "byte_level", False):
        kwargs.setdefault("n_chars", len(text))
    return perplexity(logits_fn, ids, tokenizer=tokenizer, **kwargs)
