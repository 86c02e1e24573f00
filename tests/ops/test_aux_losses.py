"""Aux losses against hand-computed values."""

import math

import torch

from moeify.ops.aux_losses import (
    batch_entropy_loss,
    cv_squared,
    moa_balance_loss,
    pooled_entropy_loss,
    router_entropy,
    sequence_prob_sums,
    switch_balance_loss,
    z_loss,
)


def test_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # logsumexp: log 2 and log 4
    want = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    assert abs(z_loss(logits).item() - want) < 1e-6
    assert abs(z_loss(logits, torch.tensor([True, False])).item() - math.log(2) ** 2) < 1e-6


def test_switch_balance_by_hand():
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8]])
    top1 = probs.argmax(-1)
    f = [2 / 3, 1 / 3]
    P = [(0.7 + 0.6 + 0.2) / 3, (0.3 + 0.4 + 0.8) / 3]
    want = 2 * (f[0] * P[0] + f[1] * P[1])
    assert abs(switch_balance_loss(probs, top1).item() - want) < 1e-6
    # padding token (the third) is excluded from both f and P
    valid = torch.tensor([True, True, False])
    want_v = 2 * (1.0 * (0.7 + 0.6) / 2 + 0.0)
    assert abs(switch_balance_loss(probs, top1, valid).item() - want_v) < 1e-6


def test_switch_balance_is_one_when_uniform():
    probs = torch.full((8, 4), 0.25)
    top1 = torch.arange(8) % 4
    assert abs(switch_balance_loss(probs, top1).item() - 1.0) < 1e-6


def test_moa_balance_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    idx = torch.tensor([[0, 1], [1, 2]])
    psum = torch.tensor([0.6, 0.9, 0.5]) / 2.0
    cnt = torch.tensor([1.0, 2.0, 1.0]) / 4.0
    want = 3 * (psum * cnt).sum().item()
    assert abs(moa_balance_loss(probs, idx).item() - want) < 1e-6


def test_cv_squared_and_entropies():
    x = torch.tensor([1.0, 2.0, 3.0])
    assert abs(cv_squared(x).item() - (1.0 / 4.0)) < 1e-6  # var (unbiased) 1, mean 2
    logits = torch.zeros(5, 4)
    assert abs(batch_entropy_loss(logits).item() + math.log(4)) < 1e-6  # minus max entropy
    assert abs(router_entropy(torch.full((3, 4), 0.25)).item() - math.log(4)) < 1e-6


def test_moa_balance_ignores_padding_and_counts_carry_no_gradient():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.9, 0.05, 0.05]],
                         requires_grad=True)
    idx = torch.tensor([[0, 1], [1, 2], [0, 2]])
    valid = torch.tensor([True, True, False])  # the third token is padding
    loss = moa_balance_loss(probs, idx, valid)
    psum = torch.tensor([0.6, 0.9, 0.5]) / 2.0  # first two tokens only
    cnt = torch.tensor([1.0, 2.0, 1.0]) / 4.0
    assert abs(loss.item() - 3 * (psum * cnt).sum().item()) < 1e-6
    loss.backward()
    # d/dp_te of E * sum_e (p_sum_e / S) * c_e with S = sum of all valid probabilities (= 2):
    # E * (c_e - sum_e' c_e' p_sum_e' / S) / S for valid tokens, 0 for padding.
    want_row = 3 * (cnt - (cnt * psum).sum()) / 2.0
    torch.testing.assert_close(probs.grad[:2], want_row.expand(2, 3))
    assert torch.count_nonzero(probs.grad[2]) == 0


def test_entropies_ignore_padding():
    logits = torch.tensor([[0.0, 0.0], [5.0, -5.0]])
    valid = torch.tensor([True, False])
    # Only the uniform first token counts: batch entropy and per-token entropy are log 2.
    assert abs(batch_entropy_loss(logits, valid).item() + math.log(2)) < 1e-6
    probs = torch.softmax(logits, -1)
    assert abs(router_entropy(probs, valid).item() - math.log(2)) < 1e-6
    assert router_entropy(probs).item() < math.log(2) - 0.1  # padding would lower it


def test_pooled_entropy_by_hand():
    # Two sequences, two "applications" of one layer, 3 experts. Sequence 1's second token is
    # padding. By hand: per sequence the mean softmax over its valid tokens of both
    # applications, minus its entropy, averaged over the sequences.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 2, 3, generator=g, dtype=torch.float64)
    b = torch.randn(2, 2, 3, generator=g, dtype=torch.float64)
    valid = torch.tensor([[True, True], [True, False]])
    s1, n1 = sequence_prob_sums(a, valid)
    s2, n2 = sequence_prob_sums(b, valid)
    got = pooled_entropy_loss(s1 + s2, n1 + n2)
    sm = lambda x: [math.exp(v) / sum(math.exp(u) for u in x) for v in x]  # noqa: E731
    want = 0.0
    for i, toks in ((0, (0, 1)), (1, (0,))):
        rows = [sm(a[i, t].tolist()) for t in toks] + [sm(b[i, t].tolist()) for t in toks]
        p = [sum(r[e] for r in rows) / len(rows) for e in range(3)]
        want += sum(q * math.log(q) for q in p) / 2
    assert abs(got.item() - want) < 1e-12
    # a sequence with no valid token takes no part (and divides nothing by zero)
    s3, n3 = sequence_prob_sums(a, torch.tensor([[True, True], [False, False]]))
    only0 = pooled_entropy_loss(s3, n3)
    s4, n4 = sequence_prob_sums(a[:1])
    assert torch.allclose(only0, pooled_entropy_loss(s4, n4))
    # heads: an extra group axis, averaged like the sequences
    h = torch.randn(2, 4, 5, 3, generator=g, dtype=torch.float64)  # [B, T, H, E]
    s, n = sequence_prob_sums(h)
    per_head = [pooled_entropy_loss(*sequence_prob_sums(h[:, :, j])) for j in range(5)]
    assert torch.allclose(pooled_entropy_loss(s, n), torch.stack(per_head).mean())
