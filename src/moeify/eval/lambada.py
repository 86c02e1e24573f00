"""LAMBADA: predict the last word of a passage (accuracy), scored as the SwitchHead authors did.

As the SwitchHead authors scored it (their evaluation code): no XL memory (every passage on its
own); teacher-forced greedy prediction of
the final word's tokens; the argmax tokens are detokenised and the prediction is correct when
their last whitespace-separated word equals the gold last word.

The passage is tokenised as context + target, where the target is the last word with the space
before it (``" word"``) and the context is everything before that space, so the target's tokens
are exactly the final word's tokens for GPT-2 BPE, SentencePiece without a dummy prefix, and
bytes. (The authors' code instead takes as many final positions as the word has characters;
their last whitespace-separated word is the same whenever those extra positions end in a space.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

from moeify.eval import paths
from moeify.eval.scoring import LogitsFn, score_continuations
from moeify.errors import MoeifyError, read_utf8


def load_lambada(path: str | Path | None = None, *, limit: int | None = None) -> list[str]:
    """Passages from a LAMBADA JSON-lines file (``{"text": ...}`` per line)."""
    p = paths.locate("lambada", path)
    if p.is_dir():
        p = p / "lambada_test.jsonl"
    texts: list[str] = []
    for lineno, line in enumerate(read_utf8(p).split("\n"), 1):
        if not line.strip():
            continue
        try:
            texts.append(str(json.loads(line)["text"]))
        except (ValueError, KeyError, TypeError) as e:
            raise MoeifyError(f"{p}:{lineno}: not a LAMBADA JSON line with a 'text' field "
                              f"({e!r})") from e
        if limit is not None and len(texts) >= limit:
            break
    if not texts:
        raise MoeifyError(f"{p} holds no passages")
    return texts


_LAST_WORD = re.compile(r"\s+(\S+)$")


def split_passage(text: str) -> tuple[str, str, str]:
    """(context, target = the whitespace before the last word + the word, gold word)."""
    stripped = text.rstrip()
    m = _LAST_WORD.search(stripped)
    if m is None or m.start() == 0:
        raise MoeifyError(f"LAMBADA passage {text[:60]!r} needs a context and a last word")
    return stripped[:m.start()], stripped[m.start():], m.group(1)


def lambada_accuracy(logits_fn: LogitsFn, tokenizer, texts: Sequence[str], *,
                     batch_size: int = 16, max_len: int | None = None,
                     return_predictions: bool = False, progress=None) -> dict:
    """Accuracy over ``texts``; ``logits_fn`` must be stateless (no memory between calls).

    Returns ``accuracy``, ``correct``, ``n`` and, with ``return_predictions``, the predicted
    words."""
    if not texts:
        raise ValueError("LAMBADA scoring needs at least one passage; the LAMBADA file holds none")
    items, gold = [], []
    for text in texts:
        context, target, word = split_passage(text)
        items.append((tokenizer.encode(context), tokenizer.encode(target)))
        gold.append(word)
    scores = score_continuations(logits_fn, items, batch_size=batch_size, max_len=max_len,
                                 greedy=True, progress=progress)
    predicted = []
    for s in scores:
        words = tokenizer.decode(s.greedy).split()
        predicted.append(words[-1] if words else "")
    correct = sum(p == g for p, g in zip(predicted, gold))
    out = {"accuracy": correct / len(items), "correct": correct, "n": len(items)}
    if return_predictions:
        out["predictions"] = predicted
    return out
