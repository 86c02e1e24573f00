"""Cached incremental decoding equals one full forward pass, for every attention layer and every
positional variant (SwitchHead appendix: the authors' drop-in layer restarts positions at 0 while
decoding; here positions continue).

Shape legend: B batch, T tokens, D d_model.
"""

import pytest
import torch

from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.kv_cache import KVCache
from moeify.layers.moa import MoAConfig
from moeify.layers.switchhead import SwitchHeadConfig

f64 = torch.float64
D, STEPS = 12, 20


pytestmark = pytest.mark.usefixtures("single_thread")


def tol(kind):
    """Exact in float64, except that SwitchHead's selection runs in float32 (Eq. 7-8): a float64
    logit that differs in its last bits between a one-token and a full-length matmul can round
    to a neighbouring float32 gate, a relative change of about 6e-8 in one gate."""
    if kind.startswith("switchhead"):
        return dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=1e-10, atol=1e-12)


def build(kind, pos):
    torch.manual_seed(0)
    if kind == "dense":
        cfg = DenseAttentionConfig(d_model=D, n_heads=2, d_head=6, pos=pos)
    elif kind == "switchhead":
        cfg = SwitchHeadConfig(d_model=D, n_heads=2, d_head=6, n_experts=4, k=2, pos=pos)
    elif kind == "switchhead_qkvo":
        cfg = SwitchHeadConfig(d_model=D, n_heads=2, d_head=6, n_experts=4, k=2, pos=pos,
                               experts=frozenset("qkvo"))
    else:
        cfg = MoAConfig(d_model=D, d_head=6, n_experts=5, k=2, pos=pos)
    m = cfg.build().double().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            # zero at init (MoA's router): make them matter
            if name in ("core.bias_u", "core.bias_v") or name == "w_router" and not p.any():
                p.normal_()
    return m


LAYERS = ["dense", "switchhead", "switchhead_qkvo", "moa"]
POS = ["xl", "rope", "none"]


def decode(m, x, *, prompt=0, **per_token):
    """Feed an optional prompt chunk, then one token at a time; per_token tensors are [B, T]."""
    cache = m.new_cache()
    outs = []
    if prompt:
        head = {k: v[:, :prompt] for k, v in per_token.items()}
        outs.append(m(x[:, :prompt], cache=cache, **head)[0])
    for t in range(prompt, x.shape[1]):
        outs.append(m(x[:, t:t + 1], cache=cache,
                      **{k: v[:, t:t + 1] for k, v in per_token.items()})[0])
    assert cache.length == x.shape[1]
    return torch.cat(outs, 1)


@pytest.mark.parametrize("pos", POS)
@pytest.mark.parametrize("kind", LAYERS)
def test_token_by_token_equals_full_forward(kind, pos):
    m = build(kind, pos)
    x = torch.randn(2, STEPS, D, dtype=f64)
    with torch.no_grad():
        full = m(x)[0]
        torch.testing.assert_close(decode(m, x), full, **tol(kind))
        torch.testing.assert_close(decode(m, x, prompt=7), full, **tol(kind))


@pytest.mark.parametrize("pos", ["xl", "rope"])
@pytest.mark.parametrize("kind", LAYERS)
def test_explicit_positions_decoding(kind, pos):
    # Non-contiguous positions (Mixture-of-Depths routes a subset of tokens): the full pass with
    # the same positions is the reference, and the positions matter.
    m = build(kind, pos)
    torch.manual_seed(1)
    x = torch.randn(2, STEPS, D, dtype=f64)
    p = torch.stack([torch.randperm(200)[:STEPS].sort().values for _ in range(2)])
    with torch.no_grad():
        full = m(x, pos_q=p)[0]
        torch.testing.assert_close(decode(m, x, pos_q=p), full, **tol(kind))
        assert not torch.allclose(full, m(x)[0])


@pytest.mark.parametrize("pos", ["xl", "rope"])
@pytest.mark.parametrize("kind", LAYERS)
def test_invalid_keys_decoding(kind, pos):
    m = build(kind, pos)
    torch.manual_seed(2)
    x = torch.randn(2, STEPS, D, dtype=f64)
    valid = torch.rand(2, STEPS) > 0.3
    valid[:, 0] = True
    with torch.no_grad():
        full = m(x, valid_k=valid)[0]
        torch.testing.assert_close(decode(m, x, valid_k=valid), full, **tol(kind))
        # An invalid token influences nobody else.
        x2 = x.clone()
        x2[~valid] += 1.0
        later = valid.clone()
        torch.testing.assert_close(m(x2, valid_k=valid)[0][later], full[later])


@pytest.mark.parametrize("pos", POS)
@pytest.mark.parametrize("kind", LAYERS)
def test_xl_memory_equals_full_forward(kind, pos):
    # Transformer-XL memory: attending over [memory ; chunk] gives the chunk's outputs of one
    # pass over the concatenation.
    m = build(kind, pos)
    x = torch.randn(2, 9, D, dtype=f64)
    with torch.no_grad():
        full = m(x)[0]
        torch.testing.assert_close(m(x[:, 5:], x)[0], full[:, 5:], **tol(kind))


def test_decoding_positions_do_not_restart():
    # The defect the spec warns about: a decoded query placed at position 0 (restarted) instead
    # of after the cached tokens. The cached step must equal the query at position 4 over all
    # five keys, and differ from the restarted placement.
    m = build("switchhead", "rope")
    x = torch.randn(1, 5, D, dtype=f64)
    with torch.no_grad():
        cache = m.new_cache()
        m(x[:, :4], cache=cache)
        step = m(x[:, 4:], cache=cache)[0]
        assert cache.positions.tolist() == [[0, 1, 2, 3, 4]]
        torch.testing.assert_close(step, m(x[:, 4:], x)[0], **tol("switchhead"))
        restarted = m(x[:, 4:], x, causal=False, pos_q=torch.tensor([[0]]),
                      pos_k=torch.arange(5)[None])[0]
        assert not torch.allclose(step, restarted)


def test_cache_basics():
    c = KVCache()
    assert c.length == 0 and len(c) == 0
    k = torch.randn(2, 3, 4, 5)
    keys, vals, pos, valid = c.append(k, k + 1, torch.arange(4).expand(2, 4))
    assert c.length == 4 and valid.all() and pos.dtype == torch.int64
    keys, vals, pos, valid = c.append(k[:, :, :1], k[:, :, :1], torch.tensor([[9], [9]]),
                                      torch.tensor([[False], [True]]))
    assert keys.shape == (2, 3, 5, 5) and torch.equal(vals[:, :, :4], k + 1)
    assert pos[:, -1].tolist() == [9, 9] and valid[:, -1].tolist() == [False, True]
    with pytest.raises(ValueError, match="positions"):
        c.append(k, k, torch.arange(3).expand(2, 3))
    with pytest.raises(ValueError, match="heads"):
        c.append(k[:, :1], k[:, :1], torch.arange(4).expand(2, 4))
    assert not c.contiguous  # appended without vouching for default positions
    c.reset()
    assert c.length == 0 and c.contiguous
    c.append(k, k, torch.arange(4).expand(2, 4), default_positions=True)
    assert c.contiguous
    c.append(k[:, :, :1], k[:, :, :1], torch.tensor([[7], [7]]))
    assert not c.contiguous  # stays so: later queries must use the stored positions
    c.append(k[:, :, :1], k[:, :, :1], torch.tensor([[8], [8]]), default_positions=True)
    assert not c.contiguous


@pytest.mark.parametrize("grad", [False, True])
def test_appends_equal_concatenation_and_earlier_views_stay(grad):
    # Under no_grad the cache writes into buffers with spare room; with gradients it
    # concatenates. Either way it holds exactly the concatenation of what was appended.
    g = torch.Generator().manual_seed(0)
    c = KVCache()
    ks, ps, seen = [], [], []
    with torch.set_grad_enabled(grad):
        for step in range(7):
            n = 3 if step == 0 else 1
            k = torch.randn(2, 3, n, 4, generator=g, requires_grad=grad)
            p = torch.full((2, n), step, dtype=torch.int32)
            keys, vals, pos, valid = c.append(k, 2 * k, p)
            ks.append(k)
            ps.append(p)
            seen.append((keys, keys.detach().clone()))
        want = torch.cat(ks, 2)
        assert c.length == want.shape[2] == 9
        torch.testing.assert_close(c.keys, want)
        torch.testing.assert_close(c.values, 2 * want)
        assert torch.equal(c.positions, torch.cat(ps, 1).long()) and c.valid.all()
    for view, copy in seen:  # nothing handed out earlier was overwritten
        assert torch.equal(view, copy)
    if grad:
        c.keys.sum().backward()
        assert all(torch.equal(k.grad, torch.ones_like(k)) for k in ks)


@pytest.mark.parametrize("kind", ["dense", "switchhead", "moa"])
def test_xl_decoding_keeps_one_growing_position_table(kind):
    # Contiguous XL decoding reads the distance table kept in the cache, grown as the cache
    # grows, instead of projecting every distance again at every step.
    m = build(kind, "xl")
    x = torch.randn(1, STEPS, D, dtype=f64)
    cache = m.new_cache()
    with torch.no_grad():
        full = m(x)[0]
        outs = [m(x[:, :5], cache=cache)[0]]
        memo = cache.derived["xl_positions"]
        for t in range(5, STEPS):
            outs.append(m(x[:, t:t + 1], cache=cache)[0])
            assert cache.derived["xl_positions"] is memo and cache.contiguous
        assert memo._rows_HRC.shape[1] >= STEPS
    torch.testing.assert_close(torch.cat(outs, 1), full, **tol(kind))


def test_decoding_a_model_built_under_inference_mode():
    # Inference tensors keep no version counter: nothing derived from them is kept, and
    # decoding still equals the full forward pass.
    with torch.inference_mode():
        m = build("dense", "xl")
        x = torch.randn(1, 6, D, dtype=f64)
        full = m(x)[0]
        torch.testing.assert_close(decode(m, x, prompt=2), full, **tol("dense"))


def test_cache_knows_when_every_token_is_valid():
    # Without any validity appended the mask need not read it (decoding's mask-free path);
    # one appended validity tensor, even all True, makes the cache consult it from then on.
    from moeify.layers.kv_cache import KVCache
    c = KVCache()
    k = torch.zeros(1, 2, 3, 4)
    c.append(k, k, torch.arange(3)[None])
    assert c.all_valid and c.valid.all()
    c.append(k[:, :, :1], k[:, :, :1], torch.tensor([[3]]), torch.tensor([[True]]))
    assert not c.all_valid
    c.reset()
    assert c.all_valid
