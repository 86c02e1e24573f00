"""BLiMP: minimal pairs, scored as the SwitchHead authors did (their evaluation code).

Each sentence scores the summed log-probability of all its tokens after the first (no length
normalisation, no memory); a pair is correct when the good sentence scores strictly higher. The
reported accuracy is the mean over paradigms (67 in the release), and per linguistic field the
mean over that field's paradigms.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from moeify.eval import paths
from moeify.eval.scoring import LogitsFn, ProgressFn, score_continuations
from moeify.errors import MoeifyError, read_utf8


@dataclass(frozen=True)
class BlimpPair:
    good: str
    bad: str
    paradigm: str
    field: str


def load_blimp(path: str | Path | None = None, *,
               limit_per_paradigm: int | None = None, flag: str = "--data") -> list[BlimpPair]:
    """Pairs from a directory of BLiMP paradigm files (or one file); ``flag`` is the option a
    missing directory's error names.

    The paradigm is the record's ``UID`` (else the file name) and the field its ``field``, one
    spelling per field (``field_name``)."""
    p = paths.locate("blimp", path, flag=flag)
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if not files:
        raise MoeifyError(f"{p} holds no BLiMP *.jsonl files")
    pairs: list[BlimpPair] = []
    for f in files:
        n = 0
        for lineno, line in enumerate(read_utf8(f).split("\n"), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                pairs.append(BlimpPair(good=r["sentence_good"], bad=r["sentence_bad"],
                                       paradigm=r.get("UID", f.stem),
                                       field=field_name(r.get("field", "unknown"))))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise MoeifyError(f"{f}:{lineno}: not a BLiMP record with sentence_good and "
                                  f"sentence_bad ({e!r})") from e
            n += 1
            if limit_per_paradigm is not None and n >= limit_per_paradigm:
                break
    return pairs


def field_name(field: str) -> str:
    """The release spells one field two ways (1 paradigm "syntax/semantics", 13
    "syntax_semantics"): one name, so that the field's mean covers all 14 paradigms."""
    return re.sub(r"[/\s-]+", "_", str(field).strip())


def sentence_items(tokenizer, sentences: Sequence[str]) -> list[tuple[list[int], list[int]]]:
    items = []
    for s in sentences:
        ids = tokenizer.encode(s)
        if len(ids) < 2:
            raise MoeifyError(f"BLiMP sentence {s!r} has fewer than two tokens: nothing to score")
        items.append((ids[:1], ids[1:]))
    return items


def blimp_accuracy(logits_fn: LogitsFn, tokenizer, pairs: Sequence[BlimpPair], *,
                   batch_size: int = 32, max_len: int | None = None,
                   progress: ProgressFn | None = None) -> dict:
    """``accuracy`` (mean over paradigms), ``paradigms`` {uid: acc}, ``fields`` {field: mean of
    its paradigms}, ``pairs`` (count). ``logits_fn`` must be stateless."""
    if not pairs:
        raise ValueError("BLiMP scoring needs at least one sentence pair; the BLiMP files (or "
                         "--limit) give none")
    sentences = [p.good for p in pairs] + [p.bad for p in pairs]
    scores = score_continuations(logits_fn, sentence_items(tokenizer, sentences),
                                 batch_size=batch_size, max_len=max_len, progress=progress)
    n = len(pairs)
    per_paradigm: dict[str, list[int]] = {}
    field_of: dict[str, str] = {}
    for i, pair in enumerate(pairs):
        ok = scores[i].total > scores[n + i].total
        per_paradigm.setdefault(pair.paradigm, []).append(int(ok))
        field_of[pair.paradigm] = pair.field
    paradigm_acc = {k: sum(v) / len(v) for k, v in sorted(per_paradigm.items())}
    fields: dict[str, list[float]] = {}
    for k, acc in paradigm_acc.items():
        fields.setdefault(field_of[k], []).append(acc)
    return {"accuracy": sum(paradigm_acc.values()) / len(paradigm_acc),
            "paradigms": paradigm_acc,
            "fields": {f: sum(v) / len(v) for f, v in sorted(fields.items())},
            "pairs": n}
