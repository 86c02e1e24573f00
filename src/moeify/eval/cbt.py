"""The Children's Book Test: loader of the official files and scoring (as the SwitchHead authors
scored it).

Official format (cbtest_{CN,NE,P,V}_test_2500ex.txt): examples separated by blank lines; lines
1-20 are numbered context sentences (``"1 text"``); line 21 is
``"21 query with XXXXX<TAB>answer<TAB><TAB>cand1|cand2|...|cand10"``. The text is tokenised
PTB-style (`` '' -LRB- n't, spaces around punctuation).

Scoring, as the SwitchHead authors did: the text is detokenised, the context is the 20 sentences
joined by spaces plus the query up to the blank; each candidate is placed in the blank followed by
the rest of the query; a candidate scores the mean log-probability of the tokens after the prefix
(length-normalised); an example is correct when the gold candidate scores strictly highest. The
reported accuracy is the mean over the four groups (CN, NE, P, V). Deliberate detail: the space
before the blank starts the continuation rather than ending the prefix, so that a word and its
leading space form one token as in running text (GPT-2 BPE, SentencePiece).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from moeify.eval import paths
from moeify.eval.scoring import LogitsFn, score_continuations
from moeify.errors import MoeifyError, read_utf8

CBT_GROUPS = ("CN", "NE", "P", "V")
BLANK = "XXXXX"


@dataclass(frozen=True)
class CBTExample:
    context: tuple[str, ...]       # the 20 sentences, line numbers removed
    query: str                     # sentence 21, containing XXXXX
    answer: str
    candidates: tuple[str, ...]    # 10 in the official files


def parse_cbt(text: str, *, source: str = "<text>") -> list[CBTExample]:
    """Examples of a CBT file's text; malformed input raises MoeifyError with the line number."""
    examples: list[CBTExample] = []
    block: list[tuple[int, str]] = []
    for lineno, raw in enumerate([*text.split("\n"), ""], 1):
        line = raw.rstrip("\r")
        if line.strip():
            block.append((lineno, line))
        elif block:
            examples.append(_parse_example(block, source))
            block = []
    return examples


def _parse_example(block: list[tuple[int, str]], source: str) -> CBTExample:
    sentences = []
    for lineno, line in block:
        number, _, body = line.partition(" ")
        if not number.isdigit():
            raise MoeifyError(f"{source}:{lineno}: expected a numbered line ('N text'), got "
                              f"{line[:40]!r}")
        sentences.append((lineno, int(number), body))
    lineno, number, last = sentences[-1]
    fields = [f for f in last.split("\t") if f]
    if len(fields) != 3:
        raise MoeifyError(f"{source}:{lineno}: the query line must be 'N query<TAB>answer<TAB>"
                          f"<TAB>cand1|...|cand10', got {len(fields)} tab-separated fields")
    query, answer, cands = fields
    candidates = tuple(c for c in cands.split("|") if c)
    if BLANK not in query:
        raise MoeifyError(f"{source}:{lineno}: the query has no {BLANK} blank")
    if answer not in candidates:
        raise MoeifyError(f"{source}:{lineno}: the answer {answer!r} is not among the candidates")
    expected = list(range(1, len(sentences) + 1))
    if [n for _, n, _ in sentences] != expected:
        raise MoeifyError(f"{source}:{block[0][0]}: lines must be numbered 1..{len(sentences)}")
    return CBTExample(context=tuple(b for _, _, b in sentences[:-1]), query=query, answer=answer,
                      candidates=candidates)


def load_cbt(path: str | Path | None = None, *, groups: Sequence[str] = CBT_GROUPS,
             limit: int | None = None) -> dict[str, list[CBTExample]]:
    """{group: examples} from a directory with the official test files (or its CBTest/data)."""
    for g in groups:
        if g not in CBT_GROUPS:
            raise ValueError(f"unknown CBT group {g!r}: choose from {', '.join(CBT_GROUPS)}")
    root = paths.locate("cbt", path)
    if (root / "CBTest" / "data").is_dir():
        root = root / "CBTest" / "data"
    out = {}
    for g in groups:
        f = root / f"cbtest_{g}_test_2500ex.txt"
        if not f.is_file():
            raise MoeifyError(f"CBT file {f} not found: the directory must hold "
                              f"cbtest_{{{','.join(CBT_GROUPS)}}}_test_2500ex.txt")
        out[g] = parse_cbt(read_utf8(f), source=str(f))[:limit]
    return out


def detokenize(text: str) -> str:
    """Undo the PTB-style tokenisation of the CBT text (the substitutions the authors applied)."""
    for a, b in ((" '", "'"), (" n't", "n't"), ("`` ", '"'), ("''", '"'), (" :", ":"),
                 (" ;", ";"), (" !", "!"), (" ?", "?"), (" ,", ","), (" .", ".")):
        text = text.replace(a, b)
    return text


def example_items(tokenizer, ex: CBTExample) -> list[tuple[list[int], list[int]]]:
    """(prefix, continuation) token pairs, one per candidate in ``ex.candidates`` order."""
    query = detokenize(ex.query)
    before, _, after = query.partition(BLANK)
    prefix = " ".join(detokenize(s) for s in ex.context) + " " + before
    stripped = prefix.rstrip()
    gap = prefix[len(stripped):]
    prefix_ids = tokenizer.encode(stripped)
    return [(prefix_ids, tokenizer.encode(gap + c + after)) for c in ex.candidates]


def cbt_accuracy(logits_fn: LogitsFn, tokenizer, examples: Mapping[str, Sequence[CBTExample]], *,
                 batch_size: int = 16, max_len: int | None = None, progress=None) -> dict:
    """``accuracy`` (mean over the groups given), ``groups`` {group: acc}, ``n`` examples.
    ``progress(done, total)``: candidates scored, over all groups."""
    if not examples:
        raise ValueError("CBT scoring needs at least one group of examples; the CBT files hold "
                         "none")
    groups = {}
    n_total = 0
    n_items = sum(len(ex.candidates) for exs in examples.values() for ex in exs)
    done = 0
    for g, exs in examples.items():
        if not exs:
            raise MoeifyError(f"CBT group {g} has no examples")
        items, spans = [], []
        for ex in exs:
            its = example_items(tokenizer, ex)
            spans.append((len(items), len(its), ex.candidates.index(ex.answer)))
            items += its
        scores = score_continuations(
            logits_fn, items, batch_size=batch_size, max_len=max_len,
            progress=None if progress is None else
            (lambda d, _t, base=done: progress(base + d, n_items)))
        done += len(items)
        correct = 0
        for ex, (start, k, gold) in zip(exs, spans):
            means = [scores[start + j].mean for j in range(k)]
            correct += all(means[gold] > m for m, c in zip(means, ex.candidates)
                           if c != ex.answer)
        groups[g] = correct / len(exs)
        n_total += len(exs)
    return {"accuracy": sum(groups.values()) / len(groups), "groups": groups, "n": n_total}
