"""Sampling: top-k / top-p filters by hand, cached generation against full forward passes,
reproducible sampling, Mixture-of-Depths models in cache mode."""

import dataclasses

import pytest
import torch

from moeify.eval.generate import filter_logits, generate, sample_next
from moeify.models.presets import get_preset


def tiny(preset, **kw):
    cfg = get_preset(preset)
    d, L = 32, 2
    attn = tuple(dataclasses.replace(a, d_model=d, n_layers=L) for a in cfg.attention)
    ff = tuple(dataclasses.replace(f, d_model=d, n_layers=L) for f in cfg.feedforward)
    depth = tuple(None if x is None else dataclasses.replace(x, d_model=d, n_layers=L)
                  for x in cfg.depth)
    cfg = dataclasses.replace(cfg, d_model=d, n_layers=L, context_length=16, vocab_size=40,
                              attention=attn, feedforward=ff, depth=depth, **kw)
    torch.manual_seed(0)
    return cfg.build().eval()


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, -2.0, 4.0]])
    out = filter_logits(logits, top_k=2)
    assert torch.isinf(out).tolist() == [[True, False, True, True, False]]
    assert out[0, 1] == 5.0 and out[0, 4] == 4.0


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    # Sorted: 0.5, 0.3 (cumulative 0.8), 0.15 (0.95), 0.05 (1.0).
    keep = {0.5: [1], 0.7: [1, 3], 0.8: [1, 3], 0.81: [1, 2, 3], 1.0: [0, 1, 2, 3]}
    for p, kept in keep.items():
        out = filter_logits(logits, top_p=p)
        got = [i for i in range(4) if torch.isfinite(out[0, i])]
        assert got == kept, (p, got)


def test_sampling_follows_the_filtered_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    ids = sample_next(logits, temperature=2.0, top_k=3, generator=g)
    freq = torch.bincount(ids, minlength=4).double() / ids.numel()
    expect = torch.softmax(torch.tensor([-float("inf"), 0.5, 1.0, 1.5]), 0).double()
    assert freq[0] == 0
    torch.testing.assert_close(freq, expect, atol=0.03, rtol=0)
    assert torch.equal(sample_next(logits[:3], temperature=0), torch.tensor([3, 3, 3]))


@pytest.mark.parametrize("preset", ["tiny-switchhead", "tiny-dense", "tiny-moa"])
def test_cached_greedy_decoding_equals_full_forward_passes(preset):
    model = tiny(preset)
    prompt = [3, 17, 5, 9, 22]
    got = generate(model, prompt, max_new_tokens=12, temperature=0)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):  # reference: re-run the whole sequence for every token
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert got == seq[len(prompt):]


def test_window_restarts_the_cache_from_recent_tokens():
    model = tiny("tiny-switchhead")
    prompt = [1, 2, 3, 4]
    got = generate(model, prompt, max_new_tokens=10, temperature=0, window=8)
    seq = list(prompt)
    with torch.no_grad():
        cached = len(prompt)
        ctx = list(prompt)
        for _ in range(10):
            if cached > 8:  # the cache would exceed the window: keep the last 4 tokens
                ctx = seq[-4:]
                cached = 4
            seq.append(int(model(torch.tensor([ctx])).logits[0, -1].argmax()))
            ctx.append(seq[-1])
            cached += 1
    assert got == seq[len(prompt):]


def test_seeded_sampling_is_reproducible_and_mod_models_decode():
    model = tiny("tiny-mod")
    a = generate(model, [1, 2, 3], max_new_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    b = generate(model, [1, 2, 3], max_new_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    assert a == b and len(a) == 20 and all(0 <= t < 40 for t in a)
    assert model.training is False


def test_bad_arguments_are_value_errors():
    model = tiny("tiny-dense")
    for kw, msg in ((dict(temperature=-1), "temperature"), (dict(top_k=0), "top_k"),
                    (dict(top_p=1.5), "top_p"), (dict(max_new_tokens=-1), "max_new_tokens")):
        with pytest.raises(ValueError, match=msg):
            generate(model, [1], **kw)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [])
    with pytest.raises(ValueError, match="token ids"):
        generate(model, [99])
