"""ListOps (Nangia & Bowman, 2018): nested list operations over digits, as a language-model corpus.

An expression is a tree whose leaves are digits 0-9 and whose inner nodes apply one operator to
two or more arguments (Nangia & Bowman's token format: ``[OP`` opens, ``]`` closes):

    MAX  the largest argument         MIN  the smallest
    MED  the median, int(np.median(args)) as in the original generator (the mean of the two
         middle values rounded down for an even count)
    SM   the sum modulo 10

    [MAX 2 9 [MIN 4 7 ] 0 ]  ->  9

The corpus holds one example per line, ``{expression} = {answer}``, so a causal language model
trained on the stream learns to write the answer after ``" = "``; ``listops_accuracy`` scores
exactly that position against the ten digits. The SwitchHead paper's attention-map figures are
of a model trained on this task.

Generation follows the original recipe (``make_data.py`` of the ListOps release, also used by
Long Range Arena): every argument is an operator with probability ``op_prob`` (0.25 there) and a
digit otherwise, an operator has between 2 and ``max_args`` arguments, nesting stops at
``max_depth``, and expressions whose length (in the format's tokens: operators, digits and
closing brackets) falls outside [min_length, max_length] are rejected. Deliberate deviations:
the root is always an operator (a lone digit is not a task), ``max_depth`` counts operator
nesting (1 = a flat list), and expressions may repeat (the small default space has few short
expressions; deduplicating would starve them, and excluding held-out expressions from training
would remove most two-digit lists from it). The answer metric therefore also reports accuracy
on the held-out expressions that never occur in training. The defaults (nesting depth 2, at
most 3 arguments, 4-16 tokens) are far smaller than the original's (depth 10, up to 5
arguments, lengths up to 2000) so that a small model learns the task on a CPU in minutes.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from moeify.errors import read_utf8
from moeify.data.corpora import Recipe, register_corpus, write_splits

OPERATORS = ("MAX", "MIN", "MED", "SM")
ANSWER_SEP = " = "
DIGITS = "0123456789"


def apply_operator(op: str, args: Sequence[int]) -> int:
    """The value of ``[op args... ]`` over already evaluated arguments."""
    if op == "MAX":
        return max(args)
    if op == "MIN":
        return min(args)
    if op == "MED":
        s = sorted(args)
        n = len(s)
        # int(np.median(...)) of the original generator: floor of the middle mean (values >= 0).
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2
    if op == "SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}; use one of {', '.join(OPERATORS)}")


@dataclass(frozen=True)
class ListOpsExample:
    expression: str
    answer: int

    @property
    def prefix(self) -> str:
        """What the model reads before writing the answer."""
        return self.expression + ANSWER_SEP

    def line(self) -> str:
        return f"{self.expression}{ANSWER_SEP}{self.answer}"


def evaluate(expression: str) -> int:
    """The value of an expression in the token format (an independent stack evaluator)."""
    stack: list[tuple[str, list[int]]] = []
    result = None
    for tok in expression.split():
        if tok.startswith("["):
            stack.append((tok[1:], []))
        elif tok == "]":
            if not stack:
                raise ValueError(f"unbalanced ']' in {expression!r}")
            op, args = stack.pop()
            value = apply_operator(op, args)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        elif tok in DIGITS and len(tok) == 1:
            if not stack:
                raise ValueError(f"digit {tok} outside any operator in {expression!r}")
            stack[-1][1].append(int(tok))
        else:
            raise ValueError(f"unexpected token {tok!r} in {expression!r}")
    if stack or result is None:
        raise ValueError(f"unbalanced or empty expression {expression!r}")
    return result


@dataclass(frozen=True, kw_only=True)
class ListOpsConfig:
    """Shape of the generated expressions.

    max_depth: deepest operator nesting (1: a flat list like ``[SM 3 4 5 ]``).
    max_args: most arguments of one operator (at least 2).
    op_prob: probability that an argument (below the root) is itself an operation.
    min_length, max_length: accepted lengths in tokens (operators, digits, closing brackets).
    """

    max_depth: int = 2
    max_args: int = 3
    op_prob: float = 0.25
    min_length: int = 4
    max_length: int = 16

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_args", "min_length", "max_length"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ListOpsConfig.{name} must be a positive integer, got {v!r}")
        if self.max_args < 2:
            raise ValueError(f"ListOpsConfig.max_args must be >= 2 (an operator takes at least "
                             f"two arguments), got {self.max_args}")
        if not 0.0 <= self.op_prob < 1.0:
            raise ValueError(f"ListOpsConfig.op_prob must lie in [0, 1), got {self.op_prob}")
        if self.max_length < 4 or self.min_length > self.max_length:
            raise ValueError(f"need 4 <= max_length and min_length <= max_length (the shortest "
                             f"expression, [MAX 1 2 ], has 4 tokens); got min_length="
                             f"{self.min_length}, max_length={self.max_length}")


def _tree(rng: random.Random, cfg: ListOpsConfig, depth: int) -> tuple[list[str], int]:
    """(tokens, value) of one operation at nesting ``depth`` (1 = root)."""
    op = OPERATORS[int(rng.random() * len(OPERATORS))]
    n_args = 2 + int(rng.random() * (cfg.max_args - 1))
    tokens, values = ["[" + op], []
    for _ in range(n_args):
        if depth < cfg.max_depth and rng.random() < cfg.op_prob:
            sub, v = _tree(rng, cfg, depth + 1)
            tokens += sub
        else:
            v = int(rng.random() * 10)
            tokens.append(DIGITS[v])
        values.append(v)
    tokens.append("]")
    return tokens, apply_operator(op, values)


def generate_examples(n: int, *, seed: int = 0, config: ListOpsConfig = ListOpsConfig(),
                      exclude: set[str] | None = None,
                      distinct: bool = True) -> list[ListOpsExample]:
    """``n`` examples, deterministic in ``seed`` (Python's Mersenne Twister). Expressions in
    ``exclude`` are skipped. With ``distinct`` no expression repeats and the new ones are added
    to ``exclude``; without it expressions keep their natural frequencies (short flat lists are
    few, so insisting on distinct ones would starve them)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    rng = random.Random(seed)
    seen = set() if exclude is None else exclude
    out: list[ListOpsExample] = []
    budget = 1000 + 200 * n
    while len(out) < n:
        budget -= 1
        if budget < 0:
            raise ValueError(f"could only generate {len(out)} of {n} distinct ListOps examples "
                             f"with {config}; widen the length range or raise max_depth / "
                             "max_args, or ask for fewer examples")
        tokens, value = _tree(rng, config, 1)
        if not config.min_length <= len(tokens) <= config.max_length:
            continue
        text = " ".join(tokens)
        if text in seen:
            continue
        if distinct:
            seen.add(text)
        out.append(ListOpsExample(text, value))
    return out


def generate_splits(*, n_train: int, n_valid: int, n_test: int, seed: int = 0,
                    config: ListOpsConfig = ListOpsConfig()) -> dict[str, list[ListOpsExample]]:
    """Train / valid / test example lists, each drawn with its own seed and the generator's
    natural frequencies (repeats included). Short expressions are few (4 x 100 two-digit flat
    lists), so held-out splits share some expressions with train; ``listops_accuracy`` reports
    the accuracy on the unseen ones separately."""
    test = generate_examples(n_test, seed=seed, config=config, distinct=False)
    valid = generate_examples(n_valid, seed=seed + 1, config=config, distinct=False)
    train = generate_examples(n_train, seed=seed + 2, config=config, distinct=False)
    return {"train": train, "valid": valid, "test": test}


def parse_line(line: str) -> ListOpsExample:
    expr, sep, answer = line.strip().rpartition(ANSWER_SEP)
    if not sep or answer not in DIGITS or len(answer) != 1:
        raise ValueError(f"not a ListOps line ('EXPRESSION = DIGIT'): {line!r}")
    return ListOpsExample(expr, int(answer))


def load_examples(corpus_or_path, split: str = "valid", *,
                  limit: int | None = None) -> list[ListOpsExample]:
    """The examples of a prepared ListOps corpus split (a Corpus, or a path to a split file)."""
    path = Path(corpus_or_path) if isinstance(corpus_or_path, (str, Path)) \
        else corpus_or_path.path(split)
    out = []
    for line in read_utf8(path).split("\n"):
        if line.strip():
            out.append(parse_line(line))
            if limit is not None and len(out) >= limit:
                break
    return out


@dataclass(frozen=True)
class ListOpsRecipe(Recipe):
    """The generated corpus; its cache key covers every generation parameter."""

    n_train: int = 100_000
    n_valid: int = 1_000
    n_test: int = 1_000
    seed: int = 0
    generator: ListOpsConfig = ListOpsConfig()

    def cache_key(self, source: str | None) -> str:
        params = {k: v for k, v in asdict(self).items() if k not in ("name", "description")}
        digest = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.name}-{digest}"

    def prepare(self, out: Path, source: str | None) -> None:
        if source is not None:
            raise ValueError("the listops corpus is generated; it takes no source")
        splits = generate_splits(n_train=self.n_train, n_valid=self.n_valid, n_test=self.n_test,
                                 seed=self.seed, config=self.generator)
        write_splits(out, {s: "".join(e.line() + "\n" for e in ex).encode()
                           for s, ex in splits.items()})


register_corpus(ListOpsRecipe(
    name="listops", byte_level=True,
    description="ListOps (Nangia & Bowman 2018): nested MAX/MIN/MED/SM over digits, "
                "'EXPR = ANSWER' per line; depth <= 2, <= 3 arguments, 4-16 tokens; "
                "100k/1k/1k examples"))


# ---------------------------------------------------------------------------- answer accuracy

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def digit_ids(tokenizer) -> list[int]:
    """The token id of each digit written right after the answer separator."""
    base = tokenizer.encode(ANSWER_SEP)
    ids = []
    for d in DIGITS:
        full = tokenizer.encode(ANSWER_SEP + d)
        if full[:len(base)] != base or len(full) != len(base) + 1:
            raise ValueError(f"the answer metric needs each digit to be one token after "
                             f"{ANSWER_SEP!r}; {type(tokenizer).__name__} encodes "
                             f"{ANSWER_SEP + d!r} as {full}: use a byte tokenizer")
        ids.append(full[-1])
    return ids


@torch.no_grad()
def listops_accuracy(logits_fn: LogitsFn, tokenizer, examples: Sequence[ListOpsExample], *,
                     batch_size: int = 64, device=None,
                     train_expressions: set[str] | None = None) -> dict:
    """Answer accuracy: the model reads ``"\\n" + expression + " = "`` (a line start, as in the
    training stream) with no memory, and its answer is the most probable of the ten digits there.

    ``logits_fn(ids_BT) -> logits_BTV`` is a stateless causal LM. Batches are right-padded, which
    a causal model never sees from earlier positions. Returns accuracy, n, the most frequent
    answer of ``examples`` and its frequency (the majority-class baseline), and per-answer counts;
    with ``train_expressions``, also the fraction of examples seen in training and the accuracy
    and majority baseline on the unseen ones.
    """
    if not examples:
        raise ValueError("listops_accuracy needs at least one example")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    digits = torch.tensor(digit_ids(tokenizer))
    seqs = [tokenizer.encode("\n" + e.prefix) for e in examples]
    answers = torch.tensor([e.answer for e in examples])
    preds = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i:i + batch_size]
        lengths = torch.tensor([len(s) for s in chunk])
        ids_BT = torch.zeros(len(chunk), int(lengths.max()), dtype=torch.long)
        for b, s in enumerate(chunk):
            ids_BT[b, :len(s)] = torch.tensor(s)
        if device is not None:
            ids_BT = ids_BT.to(device)
        logits_BTV = logits_fn(ids_BT).float().cpu()
        last_BV = logits_BTV[torch.arange(len(chunk)), lengths - 1]
        preds.append(last_BV[:, digits].argmax(-1))
    pred = torch.cat(preds)
    counts = torch.bincount(answers, minlength=10)
    majority = int(counts.argmax())
    out = {"accuracy": float((pred == answers).float().mean()), "n": len(examples),
           "majority_class": majority,
           "majority_baseline": float(counts[majority]) / len(examples),
           "answer_counts": counts.tolist(),
           "prediction_counts": torch.bincount(pred, minlength=10).tolist()}
    if train_expressions is not None:
        unseen = torch.tensor([e.expression not in train_expressions for e in examples])
        n_unseen = int(unseen.sum())
        out["seen_fraction"] = 1.0 - n_unseen / len(examples)
        out["n_unseen"] = n_unseen
        if n_unseen:
            c = torch.bincount(answers[unseen], minlength=10)
            out["accuracy_unseen"] = float((pred[unseen] == answers[unseen]).float().mean())
            out["majority_baseline_unseen"] = float(c.max()) / n_unseen
    return out


__all__ = ["ANSWER_SEP", "OPERATORS", "ListOpsConfig", "ListOpsExample", "ListOpsRecipe",
           "apply_operator", "digit_ids", "evaluate", "generate_examples", "generate_splits",
           "listops_accuracy", "load_examples", "parse_line"]
