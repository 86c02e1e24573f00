"""ListOps: generated answers against an independent recursive evaluator, the depth / length /
argument controls, determinism, disjoint splits, the corpus recipe, and the answer metric."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeify.data import load_corpus
from moeify.data.corpora import CORPORA
from moeify.data.listops import (
    ListOpsConfig,
    ListOpsExample,
    ListOpsRecipe,
    evaluate,
    generate_examples,
    generate_splits,
    listops_accuracy,
    load_examples,
)
from moeify.data.tokenizers import ByteTokenizer


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))


# --- an independent reference: recursive descent, numpy for the median (Nangia & Bowman's
# generator computes MED as int(np.median(args)))
def ref_eval(tokens, i=0):
    op = tokens[i][1:]
    i += 1
    args = []
    while tokens[i] != "]":
        if tokens[i].startswith("["):
            v, i = ref_eval(tokens, i)
        else:
            v, i = int(tokens[i]), i + 1
        args.append(v)
    fn = {"MAX": max, "MIN": min, "MED": lambda a: int(np.median(a)),
          "SM": lambda a: int(np.sum(a)) % 10}[op]
    return fn(args), i + 1


def shape_of(expr):
    """(max operator nesting, most arguments of one operator, token count, operators used)."""
    depth = max_depth = 0
    counts, widest, ops = [], 0, set()
    for tok in expr.split():
        if tok.startswith("["):
            if counts:
                counts[-1] += 1
            depth += 1
            max_depth = max(max_depth, depth)
            counts.append(0)
            ops.add(tok[1:])
        elif tok == "]":
            widest = max(widest, counts.pop())
            depth -= 1
        else:
            counts[-1] += 1
    return max_depth, widest, len(expr.split()), ops


def test_answers_match_reference_and_hand_examples():
    assert evaluate("[MAX 2 9 [MIN 4 7 ] 0 ]") == 9
    assert evaluate("[MED 1 8 3 6 ]") == 4  # (3 + 6) // 2
    assert evaluate("[SM 7 8 [MED 2 9 5 ] ]") == 0  # 7 + 8 + 5 = 20
    assert evaluate("[MIN [SM 9 9 ] 9 ]") == 8
    for ex in generate_examples(3000, seed=3, config=ListOpsConfig(max_depth=4, max_args=5)):
        tokens = ex.expression.split()
        value, end = ref_eval(tokens)
        assert end == len(tokens)
        assert ex.answer == value, ex


@pytest.mark.parametrize("depth,args,lo,hi", [(1, 3, 4, 5), (2, 5, 6, 20), (4, 4, 10, 60)])
def test_depth_args_and_length_controls(depth, args, lo, hi):
    cfg = ListOpsConfig(max_depth=depth, max_args=args, min_length=lo, max_length=hi,
                        op_prob=0.4)
    exs = generate_examples(400, seed=1, config=cfg)
    shapes = [shape_of(e.expression) for e in exs]
    assert max(s[0] for s in shapes) == depth  # the limit is reached, never passed
    assert max(s[1] for s in shapes) == args
    assert min(s[1] for s in shapes) >= 2
    assert all(lo <= s[2] <= hi for s in shapes)
    assert set().union(*(s[3] for s in shapes)) == {"MAX", "MIN", "MED", "SM"}
    assert len({e.expression for e in exs}) == len(exs)


def test_deterministic_splits():
    a = generate_splits(n_train=300, n_valid=50, n_test=50, seed=7)
    b = generate_splits(n_train=300, n_valid=50, n_test=50, seed=7)
    c = generate_splits(n_train=300, n_valid=50, n_test=50, seed=8)
    assert a == b
    assert a["train"] != c["train"] and a["valid"] != a["test"]
    assert [len(a[k]) for k in ("train", "valid", "test")] == [300, 50, 50]


def test_bad_settings_are_value_errors():
    with pytest.raises(ValueError, match="max_args"):
        ListOpsConfig(max_args=1)
    with pytest.raises(ValueError, match="min_length"):
        ListOpsConfig(min_length=30, max_length=10)
    with pytest.raises(ValueError, match="op_prob"):
        ListOpsConfig(op_prob=1.5)
    # Only 4 operators x 10 x 10 flat pairs exist: asking for more distinct ones must say so.
    with pytest.raises(ValueError, match="distinct"):
        generate_examples(500, config=ListOpsConfig(max_depth=1, max_args=2, min_length=4,
                                                    max_length=4))


def test_corpus_recipe_registered_and_parsed_back(monkeypatch):
    assert "listops" in CORPORA
    small = ListOpsRecipe(name="listops", description="test", byte_level=True, n_train=200,
                          n_valid=30, n_test=20, seed=5)
    monkeypatch.setitem(CORPORA, "listops", small)
    corpus = load_corpus("listops")
    valid = load_examples(corpus, "valid")
    assert len(valid) == 30 and len(load_examples(corpus, "train")) == 200
    assert valid == generate_splits(n_train=200, n_valid=30, n_test=20, seed=5)["valid"]
    lines = corpus.read_text("test").splitlines()
    assert len(lines) == 20 and all(" = " in ln for ln in lines)


def _oracle(tokenizer, answer_of):
    """A causal logits_fn: at each position, if the text so far ends with ' = ', put the logit
    on the digit answer_of(expression) (reading only ids[:t+1], like a causal model)."""
    V = tokenizer.vocab_size

    def fn(ids_BT):
        B, T = ids_BT.shape
        out = torch.zeros(B, T, V)
        for b in range(B):
            for t in range(T):
                text = tokenizer.decode(ids_BT[b, :t + 1].tolist())
                if text.endswith(" = "):
                    digit = answer_of(text[:-3].split("\n")[-1])
                    out[b, t, tokenizer.encode(str(digit))[0]] = 5.0
        return out
    return fn


def test_answer_accuracy_metric():
    exs = generate_examples(40, seed=11)
    tok = ByteTokenizer()
    perfect = listops_accuracy(_oracle(tok, lambda e: ref_eval(e.split())[0]), tok, exs,
                               batch_size=7)
    assert perfect["accuracy"] == 1.0 and perfect["n"] == 40
    answers = np.array([e.answer for e in exs])
    counts = np.bincount(answers, minlength=10)
    assert perfect["majority_class"] == int(counts.argmax())
    assert perfect["majority_baseline"] == pytest.approx(counts.max() / 40)
    const = listops_accuracy(_oracle(tok, lambda e: 3), tok, exs, batch_size=16)
    assert const["accuracy"] == pytest.approx((answers == 3).mean())
    wrong = listops_accuracy(_oracle(tok, lambda e: (ref_eval(e.split())[0] + 1) % 10), tok,
                             exs)
    assert wrong["accuracy"] == 0.0
    # Accuracy on expressions absent from training: an oracle right only on "seen" ones.
    seen = {e.expression for e in exs[:10]}
    half = listops_accuracy(
        _oracle(tok, lambda e: ref_eval(e.split())[0] + (0 if e in seen else 1)), tok, exs,
        train_expressions=seen)
    assert half["seen_fraction"] == pytest.approx(10 / 40) and half["n_unseen"] == 30
    assert half["accuracy"] == pytest.approx(10 / 40) and half["accuracy_unseen"] == 0.0


def test_answer_metric_needs_single_token_digits():
    class Pairs:  # a tokenizer that writes " = 7" as two tokens after the separator
        def encode(self, text):
            return [ord(ch) for ch in text] + ([0] if text[-1:].isdigit() else [])

    with pytest.raises(ValueError, match="one token"):
        listops_accuracy(lambda ids: torch.zeros(*ids.shape, 300), Pairs(),
                         [ListOpsExample("[MAX 1 2 ]", 2)])
